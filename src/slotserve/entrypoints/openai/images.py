"""The images of a chat request, as the server takes them: data: URLs always; http(s) URLs only where the
server allows them, each fetched with a timeout and a size cap; nothing else (never a path on this machine)."""

from __future__ import annotations

import asyncio

import httpx

from slotserve.entrypoints.openai.limits import RequestLimits
from slotserve.multimodal.prompts import ImageLike


async def fetch_images(sources: list[ImageLike], limits: RequestLimits) -> list[ImageLike]:
    """Each image's data: URL, or the bytes at its http(s) URL; ValueError (a 400) for anything else."""
    out: list[ImageLike] = []
    for source in sources:
        if not isinstance(source, str):
            raise ValueError("image_url: must be a URL string")
        if source.startswith("data:"):
            out.append(source)
        elif source.startswith(("http://", "https://")):
            if not limits.allow_image_urls:
                raise ValueError("image_url: this server takes images as data: URLs only (start it with "
                                 "--allow-image-urls to fetch http(s) URLs)")
            try:  # the whole download, not each read: a server that trickles bytes is cut off too
                out.append(await asyncio.wait_for(_download(source, limits), limits.image_fetch_timeout))
            except asyncio.TimeoutError:
                raise ValueError(f"image_url: {source} did not arrive within {limits.image_fetch_timeout:g} s "
                                 "(--image-fetch-timeout)") from None
        else:
            raise ValueError(f"image_url: must be a data: or http(s) URL, got {source[:40]!r}")
    return out


async def _download(url: str, limits: RequestLimits) -> bytes:
    chunks, size = [], 0
    try:
        async with (httpx.AsyncClient(timeout=limits.image_fetch_timeout, follow_redirects=True) as client,
                    client.stream("GET", url) as response):
            if response.status_code != 200:
                raise ValueError(f"image_url: {url} answered HTTP {response.status_code}")
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise ValueError(f"image_url: {url} is over {limits.max_image_bytes} bytes (--max-image-bytes)")
                chunks.append(chunk)
    except httpx.HTTPError as e:
        raise ValueError(f"image_url: cannot fetch {url} ({type(e).__name__})") from None
    return b"".join(chunks)
