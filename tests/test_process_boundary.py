"""The front end and the engine-core process share one typed protocol (engine/protocol.py): torch-free, every
message a tagged struct that decodes to its own type, and the front end imports nothing of the core."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from slotserve.engine import protocol
from slotserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    Dead,
    Debug,
    EngineCoreRequest,
    EngineStats,
    GetDebug,
    GetStats,
    Outputs,
    ProcessedRequest,
    Ready,
    RequestFailed,
    Shutdown,
    Stats,
)
from slotserve.multimodal.image_input import ImageInput
from slotserve.outputs import CompletionOutput, EmbeddingOutput, Logprob, RequestOutput
from slotserve.sampling_params import SamplingParams


def _imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_protocol_imports_without_torch():
    assert "torch" not in _imported_after("import slotserve.engine.protocol")


def test_the_front_end_imports_nothing_of_the_engine_core():
    modules = _imported_after("import slotserve.entrypoints.openai.api_server")
    core = [m for m in modules if m.startswith(("slotserve.engine.engine_core", "slotserve.engine.core_process",
                                                "slotserve.engine.model_runner", "slotserve.engine.scheduler",
                                                "slotserve.engine.worker", "slotserve.engine.executor",
                                                "slotserve.kv_cache", "slotserve.layers"))]
    assert core == []


REQUEST = ProcessedRequest("7", "hi", [1, 2], [EngineCoreRequest(
    "7#0", [1, 2], SamplingParams(max_tokens=3, stop=["x"]), 3,
    images=[ImageInput(0, 1, (2, 2, 2), b"\0" * 16, "abc")])])
STATS = EngineStats(1, 2, 10, 5, 64, 40, 10, 3)


@pytest.mark.parametrize("command", [
    AddRequest(REQUEST), AbortRequests(["7"], ["7#0"]), GetStats(4), GetDebug(5), Shutdown()])
def test_every_command_decodes_to_itself(command):
    assert protocol.decode_command(protocol.encode(command)) == command


@pytest.mark.parametrize("event", [
    Ready(64, 1000, 32, "generate"),
    Outputs([RequestOutput("7", "hi", [1, 2], [CompletionOutput(0, "a", [3], logprobs=[{3: Logprob(-0.1, 1)}])])],
            [EmbeddingOutput("8", [1], [0.5])]),
    Stats(4, STATS), Debug(5, {"pid": 1, "threads": [{"name": "IPCLoop"}]}), RequestFailed("7", "bad"), Dead("why")])
def test_every_event_decodes_to_itself(event):
    decoded = protocol.decode_event(protocol.encode(event))
    assert type(decoded) is type(event) and decoded == event


def test_a_command_is_not_an_event():
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value .Shutdown."):
        protocol.decode_event(protocol.encode(Shutdown()))
