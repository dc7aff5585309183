"""`bench spec` on a tiny model, and `bench.dev peer-spec` against stand-in llama.cpp binaries (shell scripts that
print llama-lookup's and llama-bench's lines)."""

from __future__ import annotations

import argparse
import json
import stat
import sys

import pytest

from slotserve.bench.dev.peer import PeerError
from slotserve.bench.dev.peer_spec import run_peer_spec
from slotserve.bench.spec import prompt_sets, run_spec
from slotserve.config import EngineConfig
from slotserve.engine.llm_engine import LLMEngine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DECODED = "decoded  15 tokens in    0.50 seconds, speed:   30.00 t/s"


def _engine(path, speculative_config=NGRAM) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=16, kv_cache_memory=64 << 20,
                                  speculative_config=speculative_config))


def test_bench_spec_compares_the_same_tokens_with_proposals_and_without(tiny_qwen3):
    engine = _engine(tiny_qwen3)
    result = run_spec(engine, argparse.Namespace(output_len=12, num_prompts=2, clients=[3]))
    assert result["speculative_config"] == {**NGRAM, "model": None}
    for name in ("code_edit_clients_1", "code_edit_clients_3", "chat_clients_1", "chat_clients_3"):
        row = result[name]
        assert row["same_tokens"], name
        assert row["plain"]["decode_tokens_per_s"] > 0 and row["spec"]["decode_tokens_per_s"] > 0
        assert 0.0 <= row["spec"]["acceptance_rate"] <= 1.0 and row["spec"]["mean_accepted_length"] >= 0.0
    assert engine.core.scheduler.draft_slots is not None  # left on, as configured
    with pytest.raises(ValueError, match="speculative_config"):
        run_spec(_engine(tiny_qwen3, None), argparse.Namespace(output_len=4, num_prompts=1, clients=[]))


def _tools(tmp_path, lookup: str) -> str:
    """llama-lookup running the shell's `lookup` and a llama-bench, both logging their arguments to calls.jsonl
    (a prompt has newlines)."""
    rows = json.dumps([{"n_prompt": 0, "avg_ts": 20.5}])
    for name, body in (("llama-lookup", lookup), ("llama-bench", f"echo '{rows}'")):
        path = tmp_path / name
        path.write_text(f"#!{sys.executable}\nimport json, subprocess, sys\n"
                        f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
                        f"sys.exit(subprocess.run({body!r}, shell=True).returncode)\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path)


def test_peer_spec_runs_llama_lookup_on_each_prompt_beside_the_engine(tiny_qwen3, tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"")
    args = argparse.Namespace(llama_bin=_tools(tmp_path, f"echo '{DECODED}' >&2; echo 'accept = 75.000%' >&2"),
                              model=str(gguf), num_prompts=2, output_len=16)
    engine = _engine(tiny_qwen3)
    result = run_peer_spec(engine, args)
    assert result["llama_cpp_plain_decode_tokens_per_s"] == 20.5
    for name in ("code_edit", "chat"):
        row = result[name]
        assert row["llama_cpp_decode_tokens_per_s"] == 30.0 and row["llama_cpp_acceptance_rate"] == 0.75
        assert row["decode_tokens_per_s"] > 0 and row["ratio"] > 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    lookups = [c[1:] for c in calls if c[0].endswith("llama-lookup")]
    sent = [text for prompts in prompt_sets(engine).values() for text, _ in prompts[:2]]
    assert [call[call.index("-p") + 1] for call in lookups] == sent  # the engine's prompts, as text
    for call in lookups:
        assert call[call.index("-m") + 1] == str(gguf) and call[call.index("--spec-draft-n-max") + 1] == "3"
        assert call[call.index("-n") + 1] == "16" and call[call.index("--temp") + 1] == "0"


def test_peer_spec_reports_a_failed_llama_run_with_its_words(tiny_qwen3, tmp_path):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"")
    args = argparse.Namespace(llama_bin=_tools(tmp_path, "echo 'error: unknown argument' >&2; exit 1"),
                              model=str(gguf), num_prompts=1, output_len=8)
    with pytest.raises(PeerError, match="llama-lookup exited with 1: error: unknown argument"):
        run_peer_spec(_engine(tiny_qwen3), args)
