"""What the Tinker routes do (grail/tinker/app.py parses and answers; this decides): sessions,
and each verb checked on arrival, then queued as a job (grail/tinker/jobs.py) over the trainer
(grail/tinker/trainer.py) or the sampler (grail/tinker/sampler.py).

Ids: a session is ``session-<hex>``; a training client is ``<session_id>:train:<model_seq_id>``,
the id the SDK itself derives when it creates a client from saved state; a sampling session is
``sampler-<start>-<n>`` and a request ``req-<start>-<n>``, ``<start>`` random per server start
(grail/tinker/jobs.py).

Sessions whose client died (no heartbeat for ``session_timeout_s``) are finished by a reaper
thread every ``reap_interval_s``, so their runs end without waiting for another client.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from grail.tinker import wire
from grail.tinker.checkpoints import Checkpoints
from grail.tinker.errors import NotFound, UserFault
from grail.tinker.jobs import Jobs, Result
from grail.tinker.sampler import SampleJob, Sampler, Session, Snapshot, sampling_params
from grail.tinker.trainer import LORA_ALPHA, AdamStep, LoraSpec, Trainer, new_seed, read_lora_spec

log = logging.getLogger(__name__)

MAX_RANK = 1024
# A session whose heartbeats (every 10 s from the SDK) stopped this long ago is over: its client
# died without closing. Its training clients are unloaded (their runs end) by the reaper, which
# looks every REAP_INTERVAL_S, so a dead client's run ends at most that much after the timeout.
SESSION_TIMEOUT_S = 120.0
REAP_INTERVAL_S = 10.0
REAPER_STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ModelInfo:
    """The one base model this server serves."""

    name: str
    arch: str
    tokenizer_id: str  # what the SDK's get_tokenizer() loads: a local directory or a hub id
    max_context: int


class TinkerCore:
    def __init__(
        self,
        trainer: Trainer,
        sampler: Sampler,
        checkpoints: Checkpoints,
        info: ModelInfo,
        max_pending: int,
        session_timeout_s: float = SESSION_TIMEOUT_S,
        reap_interval_s: float = REAP_INTERVAL_S,
    ) -> None:
        self.trainer, self.sampler, self.checkpoints, self.info = (
            trainer, sampler, checkpoints, info,
        )  # fmt: skip
        self.jobs = Jobs(sampler, max_pending)
        self.session_timeout_s, self.reap_interval_s = session_timeout_s, reap_interval_s
        self.sessions: dict[str, float] = {}  # id -> last heartbeat (time.monotonic)
        self.finished: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- lifetime (the app's lifespan) ----------------------------------------------------------

    def start(self) -> None:
        self.jobs.start()
        self.start_reaper()

    def start_reaper(self) -> None:
        self._reaper = threading.Thread(target=self._reap_loop, name="tinker-reaper", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        self._stopping.set()
        if self._reaper is not None:
            self._reaper.join(REAPER_STOP_TIMEOUT_S)

    def _reap_loop(self) -> None:
        while not self._stopping.wait(self.reap_interval_s):
            try:
                self.reap_stale()
            except Exception:  # never the reaper's end: the next round tries again
                log.exception("reaping stale sessions failed")

    def close(self) -> None:
        """The server stops: the reaper stops, the queued work ends (bounded by the jobs' stop
        timeout), then the runs of the training clients still loaded end too (summary.json)."""
        self.stop_reaper()
        self.jobs.stop()
        self.trainer.end_runs("server stopped")

    # ---- sessions -----------------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"session-{secrets.token_hex(8)}"
        with self._lock:
            self.sessions[session_id] = time.monotonic()
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        """False for a finished session (the SDK stops its heartbeats on a 410)."""
        with self._lock:
            if session_id in self.finished:
                return False
            if session_id not in self.sessions:
                raise NotFound(f"unknown session {session_id!r}")
            self.sessions[session_id] = time.monotonic()
        return True

    def finish_session(self, session_id: str) -> None:
        """The client closed its ServiceClient (or stopped its heartbeats): its training clients
        are unloaded (after the work they queued), freeing their adapters; what they saved stays
        on disk."""
        with self._lock:  # one check-and-remove: the reaper and the route may race here
            if self.sessions.pop(session_id, None) is None:
                raise NotFound(f"unknown session {session_id!r} (create_session first)")
            self.finished.add(session_id)

        def unload() -> None:
            with self.trainer.lock:
                mine = [m for m in self.trainer.runs if m.startswith(f"{session_id}:")]
            for model_id in mine:
                self.trainer.unload(model_id, ended="session finished")

        self.jobs.run_later(unload)

    def reap_stale(self) -> None:
        """Finish the sessions whose heartbeats stopped `session_timeout_s` ago."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, seen in self.sessions.items() if now - seen > self.session_timeout_s]
        for session_id in stale:
            with contextlib.suppress(NotFound):  # its client closed it meanwhile
                self.finish_session(session_id)
                log.warning(
                    "session %s sent no heartbeat for %g s: finished",
                    session_id,
                    self.session_timeout_s,
                )

    def _session(self, session_id: str) -> None:
        with self._lock:
            if session_id not in self.sessions:
                raise NotFound(f"unknown session {session_id!r} (create_session first)")

    def check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.info.name:
            raise NotFound(
                f"base_model {base_model!r} is not served here; this server serves "
                f"{self.info.name!r} (grail-tinker --model)"
            )

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": self.info.name,
                    "max_context_length": self.info.max_context,
                    "trainable": True,
                    "sampleable": True,
                }
            ]  # fmt: skip
        }

    # ---- training clients ---------------------------------------------------------------------

    def create_model(self, req: dict[str, Any]) -> str:
        self._session(req["session_id"])
        self.check_base_model(req["base_model"])
        lora = req.get("lora_config")
        if lora is None:
            raise UserFault("full fine-tuning is not offered here: send a lora_config")
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise UserFault(f"lora_config.rank must be an integer in [1, {MAX_RANK}], got {rank!r}")
        optimizer = (req.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserFault(f"optimizer {optimizer!r} is not offered here (adamw is)")
        seed = lora.get("seed")
        spec = LoraSpec(
            rank=rank,
            seed=new_seed() if seed is None else int(seed),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_attn=bool(lora.get("train_attn", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"

        def work() -> Result:
            self.trainer.create(model_id, spec)
            return Result(json={"model_id": model_id, "type": "create_model"})

        return self.jobs.submit(work, model_id, req["session_id"])

    def get_info(self, model_id: str) -> dict[str, Any]:
        run = self.trainer.known(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.info.arch,
                "model_name": self.info.name,
                "tokenizer_id": self.info.tokenizer_id,
            },  # fmt: skip
            "is_lora": True,
            "lora_rank": run.spec.rank,
            "model_name": self.info.name,
        }

    def training_run(self, model_id: str) -> dict[str, Any]:
        """A live training client as the RestClient's TrainingRun."""
        run = self.trainer.known(model_id)
        return {
            "training_run_id": model_id,
            "base_model": self.info.name,
            "model_owner": "local",
            "is_lora": True,
            "lora_rank": run.spec.rank,
            "last_request_time": run.last_request,
        }

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        with self.trainer.lock:
            ids = sorted(self.trainer.runs)
        runs = [self.training_run(i) for i in ids[offset : offset + limit]]
        cursor = {"offset": offset, "limit": limit, "total_count": len(ids)}
        return {"training_runs": runs, "cursor": cursor}

    def weights_info(self, tinker_path: str) -> dict[str, Any]:
        """What a saved checkpoint was made from (its training state or sampler weights)."""
        kind = "sampler_weights" if "/sampler_weights/" in tinker_path else "weights"
        spec = read_lora_spec(self.checkpoints.resolve(tinker_path, kind))
        return {
            "base_model": self.info.name, "is_lora": True, "lora_rank": spec.rank,
            "train_unembed": spec.train_unembed, "train_mlp": spec.train_mlp,
            "train_attn": spec.train_attn,
        }  # fmt: skip

    def unload(self, model_id: str) -> str:
        self.trainer.known(model_id)

        def work() -> Result:
            self.trainer.unload(model_id, ended="unloaded (unload_model)")
            return Result(json={"model_id": model_id, "type": "unload_model"})

        return self.jobs.submit(work, model_id, session_of(model_id))

    def forward_backward(self, req: wire.ForwardBackwardRequest) -> str:
        self.trainer.known(req.model_id)
        config = self.trainer.check_datums(req.data, req.loss_fn, req.loss_fn_config)

        def work() -> Result:
            outputs, metrics = self.trainer.forward_backward(
                req.model_id, req.data, req.loss_fn, config, req.forward_only
            )
            return Result(proto=wire.write_forward_backward_output(outputs, metrics))

        return self.jobs.submit(work, req.model_id, session_of(req.model_id))

    def optim_step(self, req: dict[str, Any]) -> str:
        model_id = req["model_id"]
        self.trainer.known(model_id)
        params = req.get("adam_params")
        if params is None:
            raise UserFault(
                f"optimizer params of type {(req.get('optimizer_params') or {}).get('type')!r} "
                "are not offered here (AdamParams are)"
            )
        adam = AdamStep(
            learning_rate=float(params.get("learning_rate", 1e-4)),
            beta1=float(params.get("beta1", 0.9)),
            beta2=float(params.get("beta2", 0.95)),
            eps=float(params.get("eps", 1e-12)),
            weight_decay=float(params.get("weight_decay", 0.0)),
            grad_clip_norm=float(params.get("grad_clip_norm", 0.0)),
        )

        def work() -> Result:
            return Result(json={"metrics": self.trainer.optim_step(model_id, adam)})

        return self.jobs.submit(work, model_id, session_of(model_id))

    # ---- state ----------------------------------------------------------------------------------

    def save_state(self, req: dict[str, Any]) -> str:
        model_id = req["model_id"]
        self.trainer.known(model_id)
        name = req.get("path") or f"step-{self.trainer.known(model_id).steps:06d}"
        directory = self.checkpoints.directory(model_id, "weights", name)
        if directory.exists() and not req.get("overwrite", False):
            raise UserFault(f"checkpoint {name!r} of {model_id} exists (send overwrite=True)")
        path = self.checkpoints.path(model_id, "weights", name)

        def work() -> Result:
            self.trainer.save_state(model_id, directory)
            return Result(json={"path": path, "type": "save_weights"})

        return self.jobs.submit(work, model_id, session_of(model_id))

    def load_state(self, req: dict[str, Any]) -> str:
        directory = self.checkpoints.resolve(req["path"], "weights")
        optimizer = bool(req.get("optimizer", False))
        if req.get("session_id") is not None:  # a new client, made from the state
            self._session(req["session_id"])
            self.check_base_model(req.get("base_model"))
            model_id = f"{req['session_id']}:train:{int(req['model_seq_id'])}"
            create = True
        else:
            model_id = req.get("model_id") or ""
            self.trainer.known(model_id)
            create = False

        def work() -> Result:
            self.trainer.load_state(model_id, directory, optimizer=optimizer, create=create)
            return Result(json={"path": req["path"], "model_id": model_id, "type": "load_weights"})

        return self.jobs.submit(work, model_id, session_of(model_id))

    def save_for_sampler(self, req: dict[str, Any]) -> str:
        """With a name: the adapter on disk, answered with its path. Without (what
        save_weights_and_get_sampling_client sends): a snapshot in memory and a sampling session
        over it, answered with the session's id."""
        model_id = req["model_id"]
        run = self.trainer.known(model_id)
        name = req.get("path")
        if name is not None:
            directory = self.checkpoints.directory(model_id, "sampler_weights", name)
            path = self.checkpoints.path(model_id, "sampler_weights", name)

            def save() -> Result:
                self.trainer.write_adapter(run, directory)
                return Result(json={"path": path, "type": "save_weights_for_sampler"})

            return self.jobs.submit(save, model_id, session_of(model_id))

        def snapshot() -> Result:
            tensors = self.trainer.adapter_tensors(run)
            key = self.sampler.add_ephemeral(Snapshot(tensors, LORA_ALPHA / run.spec.rank))
            session_id = self.sampler.add_session(key, None)
            return Result(
                json={"sampling_session_id": session_id, "type": "save_weights_for_sampler"}
            )

        return self.jobs.submit(snapshot, model_id, session_of(model_id))

    # ---- sampling -------------------------------------------------------------------------------

    def create_sampling_session(self, req: dict[str, Any]) -> str:
        self._session(req["session_id"])
        model_path = req.get("model_path")
        if model_path is not None:
            return self.sampler.session_for_path(model_path)
        if req.get("base_model") is None:
            raise UserFault("send model_path or base_model")
        self.check_base_model(req["base_model"])
        return self.sampler.add_session(None, None)

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        session = self.sampler.session(sampler_id)
        return {
            "sampler_id": sampler_id, "base_model": session.base_model,
            "model_path": session.model_path,
        }  # fmt: skip

    def sample(self, req: dict[str, Any]) -> tuple[str, int]:
        # The SDK always names a sampling session; a request naming weights instead (a client of
        # its own) samples from them without making a session per request.
        owner = req.get("sampling_session_id") or req.get("model_path") or self.info.name
        if req.get("sampling_session_id") is not None:
            session = self.sampler.session(req["sampling_session_id"])
        elif req.get("model_path") is not None:
            directory = self.checkpoints.resolve(req["model_path"], "sampler_weights")
            session = Session(self.info.name, req["model_path"], None)
            session.snapshot = self.sampler.snapshot_of(req["model_path"], directory)
        else:
            self.check_base_model(req.get("base_model") or "")
            session = Session(self.info.name, None, None)
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if req.get(key):
                raise UserFault(f"{key} is not offered by this server")
        if req.get("target_prompt_logprobs") is not None:
            raise UserFault("target_prompt_logprobs is not offered by this server")
        prompt: list[int] = []
        for chunk in req["prompt"]["chunks"]:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserFault(f"prompt chunk of type {chunk.get('type')!r}: text tokens only")
            prompt.extend(int(t) for t in chunk["tokens"])
        raw = req.get("sampling_params") or {}
        seed = raw.get("seed")
        job = SampleJob(
            session=session,
            prompt=prompt,
            params=sampling_params(raw),
            num_samples=int(req.get("num_samples", 1)),
            seed=None if seed is None else int(seed) % 2**63,
            prompt_logprobs=bool(req.get("prompt_logprobs")),
            last_n=req.get("prompt_logprobs_last_n"),
        )
        self.sampler.check(job)
        return self.jobs.submit_sample(job, str(owner), None), job.num_samples


def session_of(model_id: str) -> str:
    """The session a training client's id names (``<session_id>:train:<n>``)."""
    return model_id.partition(":train:")[0]
