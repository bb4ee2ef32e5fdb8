"""vLLM's own OpenAI server over the policy (rollout=vllm with rollout.openai_server=vllm): vLLM's `AsyncLLM` engine
and the FastAPI app `vllm serve` runs (`build_app` + `init_app_state`), on an event loop in a thread of the rollout
process, served by uvicorn on that loop behind grpo-cli's recording front (endpoint/vllm_front.py).

`ServedVLLM` also stands in for the offline `vllm.LLM` inside `VLLMRolloutEngine` (the calls that class makes:
generate, collective_rpc, reset_prefix_cache, sleep, wake_up), so the post-sync probe, the weight sync and any
plain rollout run on the same engine the agents are served by. Two things differ from the offline engine:

- `AsyncLLM` runs its engine core in a child process, so a weight push cannot be an in-process tensor copy. The
  policy's weights are written as one safetensors file (in the engine's dtype) into the engine's model directory
  and reloaded in place with vLLM's own `reload_weights(weights_path=...)`: a file write and read per sync
  (SmolLM2-135M in fp32 on a 2-core CPU: 1.8 s against the in-process copy's 0.85 s,
  docs/results/2026-11-28-vllm-openai-server.md). vLLM's NCCL/IPC weight-transfer engines would avoid the file on a
  GPU; they are not used yet.
- The engine starts from that file (load_format=safetensors), not from dummy weights: vLLM reloads from a path
  only with a loader that reads checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from grpo_cli.errors import UserFacingError

T = TypeVar("T")
WEIGHTS_FILE = "model.safetensors"
_START_TIMEOUT_S = 600.0
MIN_SERVED_VLLM = "0.32"  # the oldest vLLM whose server layout and render route this module was tested with


def save_weights(weights: Iterable[tuple[str, torch.Tensor]], directory: Path, dtype: torch.dtype) -> None:
    """The weights as one safetensors checkpoint in `directory` (on the CPU, in `dtype`). Tensors that share
    storage (tied embeddings) are written as copies, which safetensors requires."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu", dtype)
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))


@contextlib.contextmanager
def run_logging_kept() -> Iterator[None]:
    """The root logger's level and its handlers' levels as they were before: vLLM's server imports
    model_hosting_container_standards (its SageMaker routes), which at import sets the root logger and every handler
    on it to ERROR (its SAGEMAKER_CONTAINER_LOG_LEVEL default), silencing the run's own log lines and warnings."""
    root = logging.getLogger()
    level, handlers = root.level, [(handler, handler.level) for handler in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)


class ServedVLLM:
    """vLLM's AsyncLLM and its OpenAI app on a private event loop (module docstring); the sync methods block the
    calling thread until the loop has done the work."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: str, server_args: list[str]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpo-cli-vllm-server", daemon=True)
        self._thread.start()
        self.model_name = served_model_name
        self.engine: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        self.app: Any = None  # vLLM's FastAPI app
        self._server: Any = None  # the uvicorn server, once serve() ran
        try:
            self.call(self._start(engine_kwargs, served_model_name, server_args), _START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    async def _start(self, engine_kwargs: dict[str, Any], served_model_name: str, server_args: list[str]) -> None:
        with run_logging_kept():
            await self._build(engine_kwargs, served_model_name, server_args)

    async def _build(self, engine_kwargs: dict[str, Any], served_model_name: str, server_args: list[str]) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state
            from vllm.entrypoints.launchers.app import build_app
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.usage.usage_lib import UsageContext
            from vllm.utils.argparse_utils import FlexibleArgumentParser
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:  # the server's layout (vllm.entrypoints.launchers) is vLLM 0.32's
            raise UserFacingError(
                f"rollout.openai_server=vllm needs vLLM >= {MIN_SERVED_VLLM} ({e}): upgrade vLLM, or use "
                "rollout.openai_server=grpo_cli"
            ) from None

        vllm_config = AsyncEngineArgs(**engine_kwargs).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER
        )
        self.engine = AsyncLLM.from_vllm_config(
            vllm_config=vllm_config, usage_context=UsageContext.OPENAI_API_SERVER, disable_log_stats=True
        )
        # The server's own flags, as `vllm serve` parses them: the served name, the scale-out routes (the render
        # route the recording front asks for a call's prompt ids, and /inference/v1/generate, which verifiers'
        # trainer client calls), then the user's rollout.openai_server_args (tool and reasoning parsers, ...).
        parser = make_arg_parser(FlexibleArgumentParser())
        try:
            args = parser.parse_args(
                [
                    "--model",
                    str(engine_kwargs["model"]),
                    "--served-model-name",
                    served_model_name,
                    "--enable-scale-out",
                    "--disable-fastapi-docs",
                    *server_args,
                ]
            )
        except SystemExit:
            raise UserFacingError(
                f"rollout.openai_server_args={server_args} are not flags `vllm serve` takes (its error above): "
                "check them against `vllm serve --help`"
            ) from None
        tasks = await self.engine.get_supported_tasks()
        self.app = build_app(args, tasks, self.engine.model_config)
        await init_app_state(self.engine, self.app.state, args, tasks)

    # --- the loop ----------------------------------------------------------------------------------------------
    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def serve(self, asgi_app: Any) -> int:
        """Serve `asgi_app` (the recording front over `self.app`) with uvicorn on 127.0.0.1 at a port the OS picks;
        returns the port. Called once."""
        import uvicorn

        config = uvicorn.Config(
            asgi_app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)

        async def start() -> int:
            asyncio.get_running_loop().create_task(self._server.serve())
            while not self._server.started:
                await asyncio.sleep(0.01)
            return int(self._server.servers[0].sockets[0].getsockname()[1])

        return self.call(start(), 60)

    # --- what VLLMRolloutEngine asks of vllm.LLM -------------------------------------------------------------
    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> list[Any]:
        """Each prompt sampled with its SamplingParams (one for all, or a list), concurrently, as vllm.LLM.generate
        does; the final RequestOutputs in order."""
        from vllm.sampling_params import RequestOutputKind

        if not isinstance(params, list):
            params = [params] * len(prompts)

        async def one(prompt: Any, sampling: Any) -> Any:
            sampling = sampling.clone()
            sampling.output_kind = RequestOutputKind.FINAL_ONLY
            final = None
            async for output in self.engine.generate(prompt, sampling, request_id=f"grpo-cli-{uuid.uuid4().hex}"):
                final = output
            return final

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, params, strict=True))))

        return self.call(every())

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return self.call(self.engine.collective_rpc(method, kwargs=kwargs))

    def reset_prefix_cache(self) -> Any:
        return self.call(self.engine.reset_prefix_cache())

    def sleep(self, level: int = 1) -> None:
        self.call(self.engine.sleep(level))

    def wake_up(self) -> None:
        self.call(self.engine.wake_up())

    def shutdown(self) -> None:
        """Stop serving, shut the engine (and its core process) down, stop the loop."""
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                self.call(self._wait_stopped(), 10)
        if self._thread.is_alive():  # the engine's output handler first: it would log the core's exit as an error
            with contextlib.suppress(Exception):
                self.call(_cancel_others(), 10)
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
            self.engine = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _wait_stopped(self) -> None:
        while self._server is not None and self._server.started and self._server.servers:
            if all(not s.is_serving() for s in self._server.servers):
                return
            await asyncio.sleep(0.02)


async def _cancel_others() -> None:
    """Cancel the loop's other tasks (the engine's output handler, uvicorn's) and let them finish cancelling."""
    current = asyncio.current_task()
    others = [task for task in asyncio.all_tasks() if task is not current]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
