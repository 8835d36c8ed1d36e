"""The trainer's side of vLLM's and SGLang's NCCL weight transfer (`weight_transfer=nccl`, the
server on its own GPU): the process group the server's workers join, and the broadcasts.

Each side is built with what the server's own trainer-side examples use, imported from the
package the server runs from (the server is started with this interpreter, so the package is
importable here whenever that backend is in use):

- vLLM 0.33 (`examples/rl/rlhf_http_nccl.py`, `NCCLTrainerWeightTransferEngine`): the trainer is
  rank 0 of a `StatelessProcessGroup` (a TCPStore it hosts) and a `PyNcclCommunicator`, made by
  `vllm.distributed.weight_transfer.nccl_common.trainer_init`; the workers join through
  `POST /init_weight_transfer_engine` with `rank_offset` 1. Tensors go one broadcast per weight
  (`packed: false`: the worker then receives exactly the names, dtypes and shapes it was sent,
  the same path `NCCLWeightTransferEngine.receive_weights` takes unpacked).
- SGLang 0.5.23 (`test/srt/test_update_weights_from_distributed.py`): the trainer is rank 0 of
  `sglang.srt.utils.common.init_custom_process_group` (torch.distributed's NCCL process group
  behind a `PrefixStore` named by `group_name`, which must be the same on both sides), the
  workers join through `POST /init_weights_update_group`; tensors go by
  `torch.distributed.broadcast` from rank 0, in the order of the request's `names`.

Both rendezvous block until every rank arrives, so the server's HTTP call runs in a thread while
this process joins. Nothing here may hang a run: the joins run in daemon threads waited for
`timeout_s`; the broadcasts run on their own CUDA stream (a stuck one does not stall training)
and are waited for `timeout_s` (else a `ServerTimeoutError`). A group that timed out is given
up (`broken`), and a lone server syncs from disk from then on (grail/inference/weights/syncer.py);
a fleet's server, whose `timeout_s` is at most the fleet's deadline, is set aside instead. GPU
only: the CPU tests cover the requests (tests/test_weight_transfer_backends.py); tests/gpu/ runs
it for real.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from grail.inference import os_process
from grail.inference.errors import ServerTimeoutError, WeightSyncError

DEFAULT_TIMEOUT_S = 120.0
SGLANG_GROUP_NAME = "grail_weight_sync"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as both servers spell dtypes (getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def _in_thread(fn: Callable[[], Any], name: str) -> concurrent.futures.Future[Any]:
    """Run `fn` in a daemon thread (one stuck in NCCL must not keep the process alive)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _wait(future: concurrent.futures.Future[Any], timeout_s: float, what: str) -> Any:
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ServerTimeoutError(f"{what} did not finish within {timeout_s:g} s") from None


class NcclSender:
    """Rank 0 of a trainer-to-server group on this process's current CUDA device."""

    kind = ""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 2:
            raise ValueError(f"an NCCL group needs the trainer and >= 1 worker, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.master_address = "127.0.0.1"
        self.master_port = 0
        #: set when a join or a broadcast timed out: the group cannot be trusted again
        self.broken: str | None = None
        self._stream: torch.cuda.Stream | None = None

    def join(self, server_join: Callable[[], None]) -> None:
        """Make the group: `server_join` (the server's init request) in a thread, this side's
        join here, both waited for at most `timeout_s`."""
        if not torch.cuda.is_available():
            raise WeightSyncError("the NCCL weight transfer needs CUDA in the trainer")
        self.master_port = os_process.free_port(self.master_address)
        device = torch.cuda.current_device()  # the trainer's; a new thread starts on GPU 0

        def join_here() -> None:
            torch.cuda.set_device(device)
            self._join()

        request = _in_thread(server_join, f"grail-{self.kind}-nccl-init")
        joined = _in_thread(join_here, f"grail-{self.kind}-nccl-join")
        try:
            _wait(request, self.timeout_s, f"the {self.kind} server's join of the NCCL group")
            _wait(joined, self.timeout_s, "the trainer's join of the NCCL group")
        except WeightSyncError as exc:
            self.broken = str(exc)
            raise
        self._stream = torch.cuda.Stream()

    def send(self, tensors: list[torch.Tensor], server_receive: Callable[[], None]) -> float:
        """Broadcast `tensors` in order while `server_receive` (the server's update request,
        which returns once its workers received and loaded them) runs in a thread; seconds."""
        if self.broken is not None:
            raise WeightSyncError(f"the NCCL group was given up: {self.broken}")
        assert self._stream is not None, "join() first"
        t0 = time.perf_counter()
        request = _in_thread(server_receive, f"grail-{self.kind}-nccl-update")
        self._stream.wait_stream(torch.cuda.current_stream())
        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(self._stream):
                works = []
                for tensor in tensors:
                    if request.done():  # refused before any receive: do not wait for a peer
                        request.result()
                    works.append(self._broadcast(tensor))
                for work in works:  # torch.distributed's: our stream waits for its stream
                    if work is not None:
                        work.wait()
                done.record(self._stream)
            _wait(request, self.timeout_s, f"the {self.kind} server's receive of the weights")
            deadline = time.monotonic() + self.timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    raise ServerTimeoutError(
                        f"the NCCL broadcast did not complete within {self.timeout_s:g} s"
                    )
                time.sleep(0.001)
        except WeightSyncError as exc:
            self.broken = str(exc)
            raise
        except Exception as exc:  # a failed broadcast leaves the group unusable (NCCL)
            self.broken = f"{type(exc).__name__}: {exc}"
            raise WeightSyncError(f"NCCL broadcast failed: {self.broken}") from exc
        return time.perf_counter() - t0

    def _join(self) -> None:
        raise NotImplementedError

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        """Enqueue the broadcast of `tensor` from rank 0; a work handle to wait on, or None."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class VLLMSender(NcclSender):
    """vLLM's trainer side: `trainer_init` (StatelessProcessGroup + PyNcclCommunicator)."""

    kind = "vllm"

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(world_size, timeout_s)
        self._comm: Any = None

    def init_info(self) -> dict[str, Any]:
        """`init_info` of POST /init_weight_transfer_engine (vLLM's
        `NCCLWeightTransferInitInfo`): the workers are ranks 1.., one broadcast per weight."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "packed": False,
        }

    def _join(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self._comm = trainer_init(
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "world_size": self.world_size,
            },
            rank=0,
        )

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._comm.broadcast(tensor, src=0, stream=self._stream)  # enqueued on our stream

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None and self.broken is None:  # a broken comm may block in its abort
            comm.destroy()


class SGLangSender(NcclSender):
    """SGLang's trainer side: `init_custom_process_group` (torch.distributed, NCCL)."""

    kind = "sglang"

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(world_size, timeout_s)
        self._group: Any = None

    def init_body(self) -> dict[str, Any]:
        """The JSON of POST /init_weights_update_group (`InitWeightsUpdateGroupReqInput`)."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": 1,
            "world_size": self.world_size,
            "group_name": SGLANG_GROUP_NAME,
            "backend": "nccl",
        }

    def _join(self) -> None:
        from sglang.srt.utils.common import init_custom_process_group

        self._group = init_custom_process_group(
            backend="nccl",
            init_method=f"tcp://{self.master_address}:{self.master_port}",
            world_size=self.world_size,
            rank=0,
            group_name=SGLANG_GROUP_NAME,
            # torch's NCCL watchdog aborts a collective that takes longer than this
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        return torch.distributed.broadcast(tensor, src=0, group=self._group, async_op=True)

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            torch.distributed.destroy_process_group(group)
