"""The `slotserve` command and the developer benchmarks (`python -m slotserve.bench.dev`) in a subprocess, on a
tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_figures

TINY_ARGS = ["--kv-cache-memory", "8M", "--temperature", "0"]


def run(*args: str, stdin: str | None = None, module: str = "slotserve.entrypoints.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


def run_dev(*args: str) -> subprocess.CompletedProcess:
    return run(*args, module="slotserve.bench.dev")


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["models"], ["bench", "latency"],
                                     ["bench", "throughput"], ["bench", "embed"], ["bench", "serve"],
                                     ["bench", "quality"]])
def test_help(command):
    result = run(*command, "--help")
    assert result.returncode == 0 and "usage: slotserve" in result.stdout


@pytest.mark.parametrize("command", [[], ["kernels"], ["attention"], ["threads"]])
def test_dev_bench_help(command):
    result = run_dev(*command, "--help")
    assert result.returncode == 0 and "usage: python -m slotserve.bench.dev" in result.stdout


def test_the_developer_benchmarks_are_not_slotserve_bench():
    result = run("bench", "kernels")
    assert result.returncode == 2 and "invalid choice: 'kernels'" in result.stderr


def test_generate_streams_the_same_text_as_the_api(tiny_qwen3):
    from slotserve import LLM, SamplingParams

    result = run("generate", "Hello there", "-m", str(tiny_qwen3), "--max-tokens", "8", *TINY_ARGS)
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_qwen3), kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, top_k=20, top_p=0.8, repetition_penalty=1.05)
    assert result.stdout == llm.generate("Hello there", params)[0].outputs[0].text + "\n"


def test_chat_keeps_the_conversation_and_exits(tiny_qwen3):
    result = run("chat", "-m", str(tiny_qwen3), "--max-tokens", "4", "--no-think", *TINY_ARGS,
                 stdin="Hi\nAnd again?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two turns answered, then the prompt that read /exit


def test_models_lists_the_default_alias():
    result = run("models", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["alias"]: r for r in json.loads(result.stdout)}
    assert rows["qwen2.5-coder-0.5b"]["is_default"] and "qwen2.5-coder-1.5b" in rows


def test_bench_latency_prints_json(tiny_qwen3):
    result = run("bench", "latency", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M",
                 "--input-len", "32", "--output-len", "4", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert_figures(figures, "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_fraction_of_gemm", "weight_bytes",
                   "peak_resident_bytes", "resident_bytes_before_load", "decode_weight_bytes_per_token", "read_GBps",
                   "decode_fraction_of_read_bound")
    assert figures["resident_bytes_before_load"] < figures["peak_resident_bytes"]


def test_bench_parallel_prints_both_splits(tiny_qwen3):
    result = run("bench", "parallel", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--input-len", "16",
                 "--batch", "2", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert_figures(figures, "tp1.prefill_ms", "tp1.decode_b1_ms", "tp1.decode_b2_ms", "tp2.prefill_ms",
                   "tp2.decode_b2_ms", "tp2.decode_b2_collectives_ms", "decode_b2_ms_tp2_over_tp1")
    assert figures["tp1"]["decode_b1_collectives_ms"] == 0  # one rank has no collectives
    assert len(figures["tp2"]["resident_gib_per_rank"]) == 2


def test_bench_throughput_and_attention_print_json(tiny_qwen3):
    result = run("bench", "throughput", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "4", "--baseline-prompts", "2", "--compare-transformers",
                 "--rounds", "2")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 4 and figures["output_tokens"] == 16
    assert figures["transformers_generate"]["output_tokens"] == 16 and figures["one_at_a_time"]["requests"] == 2
    assert len(figures["transformers_rounds"]) == 2
    for r in figures["transformers_rounds"]:
        assert_figures(r, "speedup")
    assert_figures(figures, "seconds", "first_tokens_seconds", "transformers_generate.seconds",
                   "transformers_generate.first_tokens_seconds", "speedup_vs_transformers",
                   "speedup_vs_transformers_to_first_tokens", "speedup_vs_transformers_after_first_tokens",
                   "speedup_vs_one_at_a_time")
    # Counted by hand for the tiny Qwen3 (hidden 64, 4 heads of 32, 2 KV heads, MLP 128, 2 layers, tied head):
    # 19 tokens of each prompt through 2 x 49,152 linear weights, 4 head rows of 64 x 151,936, and
    # 19 * 20 / 2 attention pairs of 4 FLOPs x 2 layers x 4 heads x 32 dims.
    bound = figures["gemm_bound"]
    assert bound["flops"] == 4 * (2 * 98_304 * 19 + 2 * 64 * 151_936 * 4 + 1024 * 19 * 20 // 2)
    assert_figures(figures, "gemm_bound.gemm_fp32_GFLOPs", "gemm_bound.fraction_of_gemm_bound",
                   "speedup_vs_transformers_at_gemm_bound", "fma_peak.GFLOPs", "fma_peak.fraction_of_fma_peak",
                   "fma_peak.seconds", "speedup_vs_transformers_at_fma_peak")
    # The peak's seconds are the counted FLOPs at its rate (arithmetic on the JSON's figures, not a timing claim).
    peak = figures["fma_peak"]
    assert peak["seconds"] == pytest.approx(bound["flops"] / (peak["GFLOPs"] * 1e9), rel=1e-2, abs=1e-3)
    result = run("bench", "embed", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--num-sentences", "5")
    assert result.returncode == 0, result.stderr
    assert_figures(json.loads(result.stdout.strip().splitlines()[-1]), "embeddings_per_s")
    result = run_dev("kernels", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--prefill-len", "32",
                     "--batch", "4", "--context-len", "16", "--decode-steps", "2", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    kernels = json.loads(result.stdout.strip().splitlines()[-1])
    assert kernels["decode_attention"] in ("paged", "batched") and isinstance(kernels["native_small_gemm"], bool)
    assert isinstance(kernels["weights_in_huge_pages"], bool)
    assert_figures(kernels, "memory_read_GBps", "decode_batch1.fraction_of_bound", "memory_read_torch_alloc_GBps",
                   "memory_read_torch_sum_GBps", "prefill.gemm_bound_GFLOPs", "decode_batched.gemm_bound_GFLOPs",
                   "fma_peak_GFLOPs", "gemm_fp32_GFLOPs", "prefill.fraction_of_fma_peak",
                   "decode_batched.fraction_of_fma_peak")
    result = run_dev("kernels", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--prefill-len", "32",
                     "--batch", "4", "--context-len", "16", "--decode-steps", "2", "--repeats", "1",
                     "--quantization", "int8")
    assert result.returncode == 0, result.stderr
    int8 = json.loads(result.stdout.strip().splitlines()[-1])
    # int8 weights stream a quarter of the bytes (the float embedding is not streamed per token).
    assert int8["quantization"] == "int8"
    assert int8["decode_batch1"]["bytes_per_token_MB"] < kernels["decode_batch1"]["bytes_per_token_MB"] / 3
    result = run_dev("attention", "--num-seqs", "4", "--context-len", "40", "--repeats", "2")
    assert result.returncode == 0, result.stderr
    assert_figures(json.loads(result.stdout), "batched_gather_ms")


def test_errors_are_one_clear_line(tmp_path):
    result = run("generate", "hi", "-m", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "slotserve: error:" in result.stderr and "Traceback" not in result.stderr
    result = run("generate", "hi", "--temperature", "-1", "-m", str(tmp_path / "nowhere"))
    assert result.returncode == 2


def test_bench_throughput_skips_or_refuses_the_one_at_a_time_run(tiny_qwen3):
    args = ("bench", "throughput", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--num-prompts", "2",
            "--input-len", "8", "--output-len", "2")
    result = run(*args, "--baseline-prompts", "0")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 2 and figures["one_at_a_time"] is None and figures["speedup_vs_one_at_a_time"] is None
    result = run(*args, "--baseline-prompts", "-1")
    assert result.returncode != 0 and "baseline_prompts" in result.stderr


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_read_rate_pass_reads_every_float_once(threads):
    """The kernels benchmark's read pass (kernels/memory_read.c): each thread's share, the vector tails and the
    scalar tail, summed exactly (small integers), at lengths around its 4-vector steps."""
    import ctypes

    import torch

    from slotserve.bench.bounds import READ_ARGS, READ_SOURCE
    from slotserve.kernels import native

    read = native.function(READ_SOURCE, "slotserve_read_sum", READ_ARGS)
    if read is None:
        pytest.skip("no C compiler with OpenMP here")
    total = ctypes.c_float()
    for n in (0, 1, 63, 64, 65, 1000, 64 * 7 + 13, 100_003):
        values = torch.arange(n, dtype=torch.float32) % 7
        assert read(values.data_ptr(), n, threads, ctypes.byref(total)) == 0
        assert total.value == float(values.sum()), n


def test_bench_ubatch_prints_both_sections_and_writes_the_traces(tiny_qwen3, tmp_path):
    trace = tmp_path / "t.json"
    result = run("bench", "ubatch", "-m", str(tiny_qwen3), "--kv-cache-memory", "8M", "--input-len", "16",
                 "--prefill-batch", "2", "--decode-batch", "3", "--decode-context", "8", "--repeats", "1",
                 "--latency-ms", "1", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for section in ("real", "injected_latency"):
        for kind in ("prefill", "decode"):
            keys = ("step_ms_no_overlap", "step_ms_overlap", "speedup", "communication_ms_no_overlap",
                    "communication_ms")
            assert_figures(figures[section][kind], *keys)
            shares = [figures[section][kind]["overlap_fraction"], *figures[section][kind]["overlap_fraction_per_rank"]]
            assert all(0 <= share <= 1 for share in shares), shares
        events = json.loads(Path(figures[section]["trace"]).read_text())["traceEvents"]
        assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
        lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert {"ubatch-0", "ubatch-1", "step"} <= lanes
        assert {e["cat"] for e in events if e["ph"] == "X"} == {"compute", "communication", "step"}
    assert figures["injected_latency"]["latency_ms"] == 1 and figures["thresholds"] == {"prefill": 32, "decode": 3}
