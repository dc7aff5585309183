"""KV saves over HTTP: `POST /v1/cache/save` and `GET /v1/cache`, and llama.cpp's `/slots` endpoints.

A save computes a prompt's KV (what is cached is reused) and writes its full blocks to the disk tier
(`--kv-offload-dir`); it answers once they are on disk. Any later request whose prompt starts with those tokens
reads them back instead of computing them, in this run or after a restart with the same model. A slot, as in
llama.cpp, is the prompt of the latest request that named it (`id_slot`, default 0): `?action=save` saves it
under `filename`, `?action=restore` reads a saved one back into the memory tier and makes it the slot's,
`?action=erase` forgets it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from slotserve.engine.async_llm import AsyncLLM
from slotserve.engine.protocol import KVSave, check_save_name
from slotserve.entrypoints.openai.errors import ServerError, bad_request
from slotserve.sampling_params import SamplingParams


class CacheSaveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    name: str | None = None
    add_generation_prompt: bool = False  # a saved chat prefix ends where the next turn's messages begin
    chat_template_kwargs: dict[str, Any] | None = None


class SlotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filename: str | None = None


class SlotTable:
    """What each slot holds: the prompt token ids of the latest request that named it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.tokens: dict[int, list[int]] = {}

    def check(self, id_slot: int) -> int:
        if not isinstance(id_slot, int) or not 0 <= id_slot < self.count:
            raise bad_request(f"id_slot: must be 0..{self.count - 1}, got {id_slot!r}", "id_slot")
        return id_slot

    def record(self, id_slot: int | None, token_ids: list[int]) -> None:
        self.tokens[self.check(0 if id_slot is None else id_slot)] = list(token_ids)


def register(app: FastAPI, engine: AsyncLLM, slots: SlotTable, read, admit, render_chat) -> None:
    """Adds the routes. `read(raw, model)` parses a body, `admit(body)` checks the server takes requests,
    `render_chat(messages, add_generation_prompt, kwargs)` is the chat template's prompt."""

    def disk_dir() -> Path:
        if engine.kv_offload_dir is None:
            raise bad_request("this server has no KV disk tier; start it with --kv-offload-dir", "kv_offload_dir")
        return Path(engine.kv_offload_dir)

    def manifest(name: str) -> dict:
        check_filename(name)
        try:
            return json.loads((disk_dir() / "names" / f"{name}.json").read_text())
        except FileNotFoundError:
            raise ServerError(404, "NotFoundError", f"filename: no save named {name!r}", "filename") from None

    async def save(tokens: list[int] | str, name: str | None) -> tuple[int, int, int | None]:
        """Runs a save to its end: (prompt tokens, tokens saved, bytes its files take: named saves only)."""
        disk_dir()
        num_tokens, saved = await one_token(engine, "save", tokens, "num_saved_tokens", KVSave(name))
        if name is None:
            return num_tokens, saved, None
        try:
            written = json.loads((disk_dir() / "names" / f"{name}.json").read_text())["bytes"]
        except (OSError, ValueError, KeyError):  # a block or the manifest could not be written (the log says why)
            raise ServerError(507, "InsufficientStorageError", f"name: the save {name!r} could not be stored "
                              f"whole ({saved} tokens were); see --kv-offload-bytes and the disk", "name") from None
        return num_tokens, saved, written

    @app.post("/v1/cache/save")
    async def cache_save(raw: Request):
        body = await read(raw, CacheSaveRequest)
        admit(body)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt: give a prompt or messages, not both", "prompt")
        if body.name is not None:
            check_save_name(body.name)
        prompt = body.prompt if body.messages is None else render_chat(
            body.messages, body.add_generation_prompt, body.chat_template_kwargs or {})
        start = time.perf_counter()
        num_tokens, saved, written = await save(prompt, body.name)
        return {"object": "kv_cache.save", "name": body.name, "num_prompt_tokens": num_tokens,
                "num_saved_tokens": saved, "bytes_written": written,
                "save_ms": round((time.perf_counter() - start) * 1000, 3)}

    @app.get("/v1/cache")
    async def cache_list():
        root = disk_dir()
        data = []
        for path in sorted((root / "names").glob("*.json")):
            try:
                m = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            data.append({"name": m["name"], "num_tokens": m["num_tokens"], "created": int(m["created"])})
        return {"object": "list", "data": data}

    @app.get("/slots")
    async def slots_list():
        return [{"id": i, "id_task": -1, "n_ctx": engine.max_model_len, "is_processing": False,
                 "n_tokens": len(slots.tokens.get(i, []))} for i in range(slots.count)]

    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: int, raw: Request, action: Literal["save", "restore", "erase"]):
        slots.check(id_slot)
        body = await read(raw, SlotRequest) if await raw.body() else SlotRequest()
        admit(body)
        start = time.perf_counter()
        if action == "erase":
            return {"id_slot": id_slot, "n_erased": len(slots.tokens.pop(id_slot, []))}
        if body.filename is None:
            raise bad_request(f"filename: required to {action} a slot", "filename")
        check_filename(body.filename)
        if action == "save":
            tokens = slots.tokens.get(id_slot)
            if not tokens:
                raise bad_request(f"id_slot: slot {id_slot} holds no prompt yet", "id_slot")
            _, saved, written = await save(tokens, body.filename)
            return {"id_slot": id_slot, "filename": body.filename, "n_saved": saved, "n_written": written,
                    "timings": {"save_ms": round((time.perf_counter() - start) * 1000, 3)}}
        m = manifest(body.filename)
        if not m.get("token_ids"):
            raise bad_request(f"filename: save {body.filename!r} holds no tokens", "filename")
        # Loading: a one-token request over the saved tokens reads their blocks back into the memory tier.
        _, cached = await one_token(engine, "restore", m["token_ids"], "num_cached_tokens", None)
        slots.tokens[id_slot] = list(m["token_ids"])
        return {"id_slot": id_slot, "filename": body.filename, "n_restored": cached,
                "n_read": m["bytes"] * min(cached // m["block_size"], len(m["hashes"])) // max(len(m["hashes"]), 1),
                "timings": {"restore_ms": round((time.perf_counter() - start) * 1000, 3)}}


async def one_token(engine: AsyncLLM, kind: str, tokens: list[int] | str, field: str,
                    kv_save: KVSave | None) -> tuple[int, int]:
    """Runs a one-token request over `tokens` to its end: (prompt tokens, the largest `field` its outputs held)."""
    stream = await engine.add_request(f"{kind}-{time.monotonic_ns()}", tokens,
                                      SamplingParams(temperature=0, max_tokens=1), kv_save=kv_save)
    largest = 0
    try:
        async for out in stream:
            largest = max(largest, getattr(out, field))
    finally:
        await stream.aclose()
    return len(stream.prompt_token_ids), largest


def check_filename(name: str) -> None:
    try:
        check_save_name(name)
    except ValueError as e:
        raise bad_request(str(e).replace("name:", "filename:", 1), "filename") from None
