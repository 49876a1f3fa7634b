"""`hybrid serve`: an OpenAI-compatible HTTP server for one model, with continuous batching,
speculative decoding and a prompt cache shared by all requests.

    from mlx_hybrid import load
    from mlx_hybrid.server import Loaded, Server

    # load runs on the model's worker thread (see engine), with a speculator as Loaded's third field if any
    server = Server(lambda: Loaded(*load("path/to/model")), "my-model", port=8080)
    server.start()  # loads the model, then listens on 127.0.0.1:8080
    ...
    server.stop()

The HTTP stack is Starlette on uvicorn: asyncio, so a waiting or streaming client costs no
thread; Starlette cancels a stream whose client disconnected, which is what stops its job; and
both are small, widely used libraries (FastAPI's base). Requests are validated with pydantic.
The model itself runs on one worker thread (`engine`). docs/server.md describes the API.
"""

import socket
import threading
import time
from typing import Callable

import uvicorn

from mlx_hybrid.errors import HybridError
from mlx_hybrid.server.app import create_app
from mlx_hybrid.server.engine import Engine, Loaded

__all__ = ["Loaded", "Server"]


class Server:
    """The app on uvicorn, on a thread of its own (`start`/`stop`), or in the foreground (`run`)."""

    def __init__(
        self, load: Callable[[], Loaded], model_id: str, host: str = "127.0.0.1", port: int = 8080, *,
        max_batch: int = 16, prompt_cache_bytes: int = 2 * 10**9, default_temp: float | None = None,
    ):
        self.engine = Engine(load, max_batch=max_batch, prompt_cache_bytes=prompt_cache_bytes)
        self.model_id, self.host, self.port = model_id, host, port
        app = create_app(self.engine, model_id, default_temp)
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _socket(self) -> socket.socket:
        """Bind before serving, so that port 0 picks a free port that `url` then names."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP given, not left 0: asyncio turns Nagle's algorithm off only on sockets that
        # say they are TCP, and with it on a response's body waits ~40 ms for the headers' ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise HybridError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = sock.getsockname()[1]
        sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
        return sock

    def start(self, timeout: float = 30.0):
        """Load the model, then serve on a background thread; returns once it accepts requests."""
        self.engine.start()
        sock = self._socket()
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, name="mlx-hybrid-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)

    def run(self, on_ready: Callable[[str], None] | None = None):
        """Load the model and serve in the foreground until interrupted (Ctrl-C)."""
        self.engine.start()
        sock = self._socket()
        if on_ready:
            on_ready(self.url)
        try:
            self.uvicorn.run(sockets=[sock])
        finally:
            self.engine.stop()

    def stop(self):
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join()
        self.engine.stop()
