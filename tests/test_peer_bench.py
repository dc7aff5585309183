"""`bench.dev peer`'s llama-bench runner against a stand-in llama-bench (a shell script): it reads llama-bench's
JSON rows, and a run that dies of SIGILL (llama.cpp's repacked AMX GEMM on some Xeons) is run again with
`--repack 0`, which the figures report."""

from __future__ import annotations

import json
import stat

import pytest

from slotserve.bench.dev.peer import NO_REPACK, LlamaBench, PeerError

ROWS = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 300.5}, {"n_prompt": 0, "n_gen": 64, "avg_ts": 40.25}])


def _fake(tmp_path, body: str) -> str:
    """A llama-bench that logs its arguments to calls.log, then runs `body`."""
    path = tmp_path / "llama-bench"
    path.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls.log\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_run_reads_prefill_and_decode_rates(tmp_path):
    llama = LlamaBench(_fake(tmp_path, f"echo '{ROWS}'"), "model.gguf")
    assert llama.round(512, 64, 2) == (300.5, 40.25)
    assert llama.config() == {"repack": True, "options": []}
    assert (tmp_path / "calls.log").read_text().split() == [
        "-m", "model.gguf", "-p", "512", "-n", "64", "-r", "1", "-t", "2", "-o", "json"]


def test_an_illegal_instruction_reruns_without_repacking_and_says_so(tmp_path):
    # Dies of SIGILL unless told --repack 0, as llama.cpp's AMX path does on the Xeons here.
    body = f'case "$*" in *"--repack 0"*) echo \'{ROWS}\';; *) kill -ILL $$;; esac'
    llama = LlamaBench(_fake(tmp_path, body), "model.gguf")
    assert llama.round(512, 64, 2) == (300.5, 40.25)
    assert llama.config() == {"repack": False, "options": NO_REPACK}
    llama.round(512, 64, 2)  # later rounds go straight to the configuration that ran
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.endswith("--repack 0") for c in calls] == [False, True, True]


def test_another_failure_is_an_error_with_the_tools_words(tmp_path):
    llama = LlamaBench(_fake(tmp_path, "echo 'error: failed to load model' >&2; exit 1"), "model.gguf")
    with pytest.raises(PeerError, match="exited with 1: error: failed to load model"):
        llama.round(512, 64, 2)
    dies_anyway = LlamaBench(_fake(tmp_path, "kill -ILL $$"), "model.gguf")
    with pytest.raises(PeerError, match=r"--repack 0 exited with -4"):
        dies_anyway.round(512, 64, 2)
