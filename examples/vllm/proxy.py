"""A small asyncio proxy for disaggregated serving: each request to P, then to D.

Pull mode (vLLM's convention, as NixlConnector's proxies do it): the request goes to a
prefill instance (P) with ``kv_transfer_params={"do_remote_decode": true}`` and
``max_tokens=1``; P's answer carries the parameters of its KV, and the same request goes to a
decode instance (D) with them verbatim. D loads the KV instead of computing it, and its answer
(streamed or not) is the client's.

Push mode (``--mode push``): the proxy sends the request to P and D at once with a shared
``transfer_id``; D tells P where its blocks are and P writes each layer as it computes it, so
D's wait overlaps P's prefill. D must know P's connector address: the proxy learns it from P's
first answer (until then a push request goes to P first, and P pushes once D asks).

    python examples/vllm/proxy.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 [--mode push]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

#: P's parameters a push-mode D request needs (P's connector address).
ADDRESS_KEYS = ("remote_host", "remote_port", "remote_ranks", "remote_engine_id", "tp_size")


class Proxy:
    """Routes each client request through a prefill and a decode instance."""

    def __init__(self, prefill: list[str], decode: list[str], mode: str = "pull") -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {mode!r}")
        self.mode = mode
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._addresses: dict[str, dict[str, Any]] = {}
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        """The aiohttp application (``/v1/completions``, ``/v1/chat/completions``,
        ``/health``)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self, _: web.Request) -> web.Response:
        """200 once the proxy runs."""
        return web.Response(text="ok")

    async def _prefill_request(
        self, url: str, path: str, body: dict[str, Any], params: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        prefill = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
        for key in ("max_completion_tokens", "min_tokens", "stream_options"):
            prefill.pop(key, None)
        if path.endswith("chat/completions"):
            prefill["max_completion_tokens"] = 1
        async with self._session.post(url + path, json=prefill) as response:
            return response.status, await response.json(content_type=None)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one completion through P and D."""
        body = await request.json()
        path = request.path
        p_url, d_url = next(self._prefill), next(self._decode)
        address = self._addresses.get(p_url)
        if self.mode == "push" and address is not None:
            transfer_id = uuid.uuid4().hex
            to_p = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": transfer_id}
            to_d = {
                "do_remote_prefill": True,
                "transfer_mode": "push",
                "transfer_id": transfer_id,
                **address,
            }
            prefill = asyncio.ensure_future(self._prefill_request(p_url, path, body, to_p))
            decode = asyncio.ensure_future(
                self._decode_request(request, d_url, path, body, to_d, prefill)
            )
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode.done():
                status, answer = prefill.result()
                if status != 200:  # P refused it: D would wait for a push that never comes
                    decode.cancel()
                    return web.json_response(answer, status=status)
            try:
                return await decode
            finally:
                if not prefill.done():
                    prefill.cancel()
        to_p = {"do_remote_decode": True}
        if self.mode == "push":
            to_p.update(transfer_mode="push", transfer_id=uuid.uuid4().hex)
        status, answer = await self._prefill_request(p_url, path, body, to_p)
        params = answer.get("kv_transfer_params") if status == 200 else None
        if not params:
            return web.json_response(answer, status=status if status != 200 else 502)
        self._addresses[p_url] = {k: params[k] for k in ADDRESS_KEYS if k in params}
        return await self._decode_request(request, d_url, path, body, params, None)

    async def _decode_request(
        self,
        request: web.Request,
        url: str,
        path: str,
        body: dict[str, Any],
        params: dict[str, Any],
        prefill: asyncio.Future[tuple[int, dict[str, Any]]] | None,
    ) -> web.StreamResponse:
        assert self._session is not None
        decode = dict(body, kv_transfer_params=params)
        async with self._session.post(url + path, json=decode) as response:
            if not body.get("stream"):
                answer = await response.read()
                if prefill is not None:
                    status, p_answer = await prefill
                    if status != 200:  # P refused: say so rather than D's answer
                        return web.json_response(p_answer, status=status)
                return web.Response(
                    body=answer, status=response.status, content_type="application/json"
                )
            out = web.StreamResponse(status=response.status)
            out.content_type = response.content_type
            await out.prepare(request)
            async for chunk in response.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="a P's base URL")
    parser.add_argument("--decode", action="append", required=True, help="a D's base URL")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull")
    args = parser.parse_args()
    proxy = Proxy(args.prefill, args.decode, args.mode)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}", "mode": args.mode}), flush=True)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
