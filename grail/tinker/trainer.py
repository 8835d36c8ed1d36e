"""The training side of the Tinker server: one frozen base model, one LoRA adapter (peft) per
training client, and each client's own AdamW.

Every method here runs on the job thread (grail/tinker/jobs.py), one request at a time in
arrival order, so two clients never share a forward pass and switching the active adapter is
safe. A forward/backward accumulates gradients (the loss is a sum, see grail/tinker/losses.py);
``optim_step`` applies them with the AdamParams the client sent for that step, then clears them,
and writes one metrics record (grail/tinker/record.py).

A training state (``save_state``) is a directory: the adapter in peft's format
(``adapter_config.json`` + ``adapter_model.safetensors``, which ``PeftModel.from_pretrained``
loads) plus ``optimizer.pt`` (AdamW's state, in the adapter parameters'
order, and the step count). Loading it into a new client with the optimizer gives the same next
loss, bit for bit, as continuing the saved one.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from grail.algo.logprobs import token_logprobs
from grail.core.records import atomic_write_text
from grail.models.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from grail.tinker import losses
from grail.tinker.checkpoints import run_dir_of
from grail.tinker.errors import NotFound, UserFault
from grail.tinker.record import StepStats, write_run_summary, write_step_record
from grail.tinker.wire import Datum

log = logging.getLogger(__name__)

OPTIMIZER_STATE = "optimizer.pt"
LORA_SPEC = "tinker_lora.json"  # the SDK's LoRA settings the adapter was made from
# LoRA's scale is alpha / rank; a fixed alpha keeps the update size of a learning rate the same
# across ranks at rank 32 (the SDK's default rank) and scales it by 32 / rank elsewhere.
LORA_ALPHA = 32
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
# Tokens per forward pass when a request's datums are batched (right-padded rows).
MICROBATCH_TOKENS = 8192
# How long the end of the runs waits for a step still running (a job thread past its stop time).
END_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def peft_config(self, names: set[str]) -> PeftLoraConfig:
        """peft's config for a model whose linear layers are called ``names`` (q_proj, ...)."""
        wanted = (
            (ATTN_MODULES if self.train_attn else ())
            + (MLP_MODULES if self.train_mlp else ())
            + (UNEMBED_MODULES if self.train_unembed else ())
        )
        targets = [n for n in wanted if n in names]
        if not targets:
            raise UserFault(
                "the LoRA config selects no layer of this model (train_attn, train_mlp and "
                f"train_unembed pick {', '.join(wanted) or 'none'}; its linear layers are "
                f"{', '.join(sorted(names))})"
            )
        return PeftLoraConfig(
            r=self.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
            bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip

    def shape(self) -> tuple[int, bool, bool, bool]:
        """What decides the adapter's tensors (the seed only draws their first values)."""
        return (self.rank, self.train_mlp, self.train_attn, self.train_unembed)


@dataclass
class AdamStep:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


@dataclass
class TrainingRun:
    """One training client: its adapter (named ``adapter`` in the peft model), optimizer and
    what it has done since its last optimizer step."""

    model_id: str
    adapter: str
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    run_dir: Path
    steps: int = 0
    pending: StepStats = field(default_factory=StepStats)
    # When a request of this client last ran (ISO 8601, UTC): the RestClient's TrainingRun.
    last_request: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    started: float = field(default_factory=time.perf_counter)  # summary.json's wall_time_s


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        base_model: str,
        run_dir: Path,
        max_context: int,
        max_clients: int,
    ) -> None:
        self.base = model
        self.base.requires_grad_(False)
        self.base_model, self.run_dir = base_model, run_dir
        self.max_context, self.max_clients = max_context, max_clients
        embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
        self.vocab_size = int(embeddings.weight.shape[0])
        self.device = next(model.parameters()).device
        # The last name part of every linear layer, read before peft wraps them.
        self.linear_names = {
            n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self.peft: PeftModel | None = None
        self.runs: dict[str, TrainingRun] = {}
        self._names = 0
        # The routes read `runs` (is this model_id known?) while jobs add and remove entries.
        self.lock = threading.Lock()
        # Held by a step while it updates and writes its record, and by `end_runs`: a run's
        # summary.json always comes after its last record.
        self._recording = threading.Lock()
        self._ended = False

    # ---- clients ------------------------------------------------------------------------------

    def known(self, model_id: str) -> TrainingRun:
        with self.lock:
            run = self.runs.get(model_id)
        if run is None:
            raise NotFound(f"unknown model_id {model_id!r} (no training client of that id here)")
        run.last_request = datetime.now(UTC).isoformat()
        return run

    def create(self, model_id: str, spec: LoraSpec) -> TrainingRun:
        """A new training client with a fresh adapter (B = 0: it starts as the base model),
        initialised from ``spec.seed``."""
        with self.lock:
            if model_id in self.runs:
                raise UserFault(f"model_id {model_id!r} exists already")
            if len(self.runs) >= self.max_clients:
                raise UserFault(
                    f"this server holds at most {self.max_clients} training clients at once "
                    "(--max-training-clients); unload one first"
                )
        self._names += 1
        adapter = f"client{self._names}"
        config = spec.peft_config(self.linear_names)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(spec.seed)  # peft draws A from the global generator
            # A LoRA on a tied output layer adds to the output only (the sampler unties it too).
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, config)
        params = self._adapter_params(adapter)
        optimizer = torch.optim.AdamW(params, lr=0.0, foreach=False)
        run_dir = run_dir_of(self.run_dir, model_id)
        run = TrainingRun(model_id, adapter, spec, params, optimizer, run_dir)
        with self.lock:
            self.runs[model_id] = run
        return run

    def unload(self, model_id: str, ended: str = "unloaded") -> None:
        """Drop a training client's adapter and optimizer; its run ends (summary.json says
        how: `ended`)."""
        run = self.known(model_id)
        assert self.peft is not None
        with self.lock:
            del self.runs[model_id]
        self._summarise(run, ended)
        if self.runs:
            self.peft.delete_adapter(run.adapter)
        else:  # peft cannot delete its last adapter: drop the wrapper, the base is untouched
            self.base = self.peft.unload()
            self.peft = None

    def end_runs(self, ended: str, timeout: float = END_TIMEOUT_S) -> None:
        """The server stops: each loaded client's run ends (its summary.json), adapters kept.
        A step still running (its job outlived the job threads' stop timeout) writes its record
        first, within `timeout`; no step is taken after."""
        recording = self._recording.acquire(timeout=timeout)
        if not recording:
            log.warning("a step still running after %g s: summaries written beside it", timeout)
        try:
            self._ended = True
            with self.lock:
                runs = list(self.runs.values())
            for run in runs:
                self._summarise(run, ended)
        finally:
            if recording:
                self._recording.release()

    def _summarise(self, run: TrainingRun, ended: str) -> None:
        try:
            write_run_summary(run.run_dir, run.model_id, time.perf_counter() - run.started, ended)
        except OSError as exc:  # a full disk, say: the run's records stay, only the summary lacks
            log.warning("summary.json of %s not written: %s", run.model_id, exc)

    def _adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        assert self.peft is not None
        marker = f".{adapter}."
        params = [p for n, p in self.peft.named_parameters() if marker in n]
        for p in params:
            p.requires_grad_(True)
        return params

    @contextmanager
    def _active(self, run: TrainingRun) -> Iterator[PeftModel]:
        assert self.peft is not None
        # Only the active adapter takes part in the forward pass (and gets gradients); each
        # client's optimizer holds its own adapter's parameters.
        self.peft.set_adapter(run.adapter)
        yield self.peft

    # ---- forward / backward -------------------------------------------------------------------

    def check_datums(
        self, data: list[Datum], loss_fn: str, config: dict[str, float | str]
    ) -> dict[str, float]:
        """Refuse, before queueing, what the job would fail on: an unsupported loss or config,
        a datum without its inputs, of the wrong length, longer than the context, with token ids
        outside the vocabulary or a NaN/inf in its numbers."""
        numeric = losses.check_loss(loss_fn, config)
        if not data:
            raise UserFault("forward_backward got no datums")
        needed = ("target_tokens", *losses.REQUIRED_INPUTS[loss_fn])
        for i, datum in enumerate(data):
            n = len(datum.tokens)
            if n == 0:
                raise UserFault(f"datum {i}: model_input is empty")
            if n > self.max_context:
                raise UserFault(
                    f"datum {i}: {n} tokens, longer than the model's context of "
                    f"{self.max_context} tokens"
                )
            for key in needed:
                if key not in datum.inputs:
                    raise UserFault(f"datum {i}: {loss_fn} needs loss_fn_inputs[{key!r}]")
            for key, tensor in datum.inputs.items():
                if tensor.values.size != n:
                    raise UserFault(
                        f"datum {i}: loss_fn_inputs[{key!r}] has {tensor.values.size} values for "
                        f"{n} input tokens (one per position)"
                    )
                if tensor.values.dtype.kind == "f" and not np.isfinite(tensor.values).all():
                    raise UserFault(f"datum {i}: loss_fn_inputs[{key!r}] holds NaN or inf")
            ids = [*datum.tokens, *datum.inputs["target_tokens"].values.tolist()]
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise UserFault(
                    f"datum {i}: token id {min(ids) if min(ids) < 0 else max(ids)} is outside "
                    f"the vocabulary [0, {self.vocab_size})"
                )
        return numeric

    def forward_backward(
        self,
        model_id: str,
        data: list[Datum],
        loss_fn: str,
        config: dict[str, float],
        forward_only: bool,
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Per datum ``logprobs`` and ``elementwise_loss`` (numpy float32), and ``loss:sum``;
        with gradients accumulated into the client's adapter unless ``forward_only``."""
        run = self.known(model_id)
        start = time.perf_counter()
        outputs: list[dict[str, Any]] = []
        total = 0.0
        with self._active(run) as model:
            for batch in _microbatches(data):
                with torch.set_grad_enabled(not forward_only):
                    logps = self._target_logprobs(model, batch)
                    loss = logps[0].new_zeros(())
                    for datum, logp in zip(batch, logps, strict=True):
                        inputs = {
                            k: torch.from_numpy(t.values.copy()).to(self.device, torch.float32)
                            for k, t in datum.inputs.items()
                            if k != "target_tokens"
                        }
                        per_token = losses.LOSSES[loss_fn](logp, inputs, config)
                        loss = loss + per_token.sum()
                        outputs.append({
                            "logprobs": logp.detach().float().cpu().numpy(),
                            "elementwise_loss": per_token.detach().float().cpu().numpy(),
                        })  # fmt: skip
                        if not forward_only:
                            run.pending.add_datum(datum, logp.detach(), loss_fn, config)
                    if not forward_only:
                        if not torch.isfinite(loss):
                            for p in run.params:  # half a batch's gradient is no gradient
                                p.grad = None
                            run.pending = StepStats()
                            raise UserFault(
                                f"the {loss_fn} loss is {loss.item()} (NaN or inf); the gradient "
                                "accumulated since the last optim_step was dropped"
                            )
                        loss.backward()
                total += float(loss.detach())
        if not forward_only:
            run.pending.loss += total
            run.pending.train_s += time.perf_counter() - start
        return outputs, {"loss:sum": total}

    def _target_logprobs(self, model: torch.nn.Module, batch: list[Datum]) -> list[torch.Tensor]:
        """log softmax(logits_t)[target_t] for each datum's positions, right-padded rows."""
        width = max(len(d.tokens) for d in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, d in enumerate(batch):
            n = len(d.tokens)
            ids[row, :n] = torch.tensor(d.tokens)
            targets[row, :n] = torch.from_numpy(d.inputs["target_tokens"].values.astype("int64"))
            mask[row, :n] = 1
        ids, targets, mask = ids.to(self.device), targets.to(self.device), mask.to(self.device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp = token_logprobs(logits, targets)
        return [logp[row, : len(d.tokens)] for row, d in enumerate(batch)]

    # ---- optimizer step -------------------------------------------------------------------------

    def optim_step(self, model_id: str, adam: AdamStep) -> dict[str, float]:
        """One AdamW step (decoupled weight decay) with the client's hyperparameters; gradients
        clipped to ``grad_clip_norm`` (0: no clipping). Writes the step's metrics record."""
        run = self.known(model_id)
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(adam, name)
            if not math.isfinite(value) or value < 0:
                raise UserFault(f"AdamParams.{name} = {value}: must be a finite number >= 0")
        if not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
            raise UserFault(f"AdamParams betas ({adam.beta1}, {adam.beta2}) must be in [0, 1)")
        start = time.perf_counter()
        grads = [p.grad for p in run.params if p.grad is not None]
        norm = (
            float(
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            )
            if grads
            else 0.0
        )
        if not math.isfinite(norm):
            for p in run.params:
                p.grad = None
            raise UserFault(
                f"the gradient norm is {norm}; the step was skipped and the gradient dropped"
            )
        if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
            scale = adam.grad_clip_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        for group in run.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                weight_decay=adam.weight_decay,
            )  # fmt: skip
        with self._recording:  # the step and its record, or neither once the runs have ended
            if self._ended:
                raise UserFault("the server is stopping: the step was not taken")
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.steps += 1
            stats, run.pending = run.pending, StepStats()
            stats.train_s += time.perf_counter() - start
            write_step_record(
                run.run_dir, run.steps - 1, stats, norm, adam.learning_rate, run.model_id
            )
        return {"grad_norm:mean": norm, "learning_rate:mean": adam.learning_rate}

    # ---- state ----------------------------------------------------------------------------------

    def adapter_tensors(self, run: TrainingRun) -> dict[str, torch.Tensor]:
        """The adapter in peft's file format (names without the adapter name), detached copies."""
        assert self.peft is not None
        # Without the flag peft adds the (frozen) embeddings when the output layer is a target.
        state = get_peft_model_state_dict(
            self.peft, adapter_name=run.adapter, save_embedding_layers=False
        )
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}

    def write_adapter(self, run: TrainingRun, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        config = run.spec.peft_config(self.linear_names).to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        config["base_model_name_or_path"] = self.base_model
        save_file(self.adapter_tensors(run), str(directory / ADAPTER_WEIGHTS))
        atomic_write_text(directory / ADAPTER_CONFIG, json.dumps(config, indent=2, default=str))
        atomic_write_text(directory / LORA_SPEC, json.dumps(asdict(run.spec), indent=2))

    def save_state(self, model_id: str, directory: Path) -> None:
        run = self.known(model_id)
        self.write_adapter(run, directory)
        state = {"optimizer": run.optimizer.state_dict(), "steps": run.steps}
        tmp = directory / (OPTIMIZER_STATE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(directory / OPTIMIZER_STATE)

    def load_state(self, model_id: str, directory: Path, *, optimizer: bool, create: bool) -> None:
        """Into client ``model_id`` (made here when ``create``, with the saved LoRA config):
        the adapter, and with ``optimizer`` AdamW's state and the step count. An existing client
        takes a checkpoint of its shape (rank, modules) and base model, whatever its seed: the
        loaded weights replace the ones the seed drew."""
        saved = read_lora_spec(directory)
        base = _saved_base_model(directory)
        if base is not None and base != self.base_model:
            raise UserFault(
                f"checkpoint {directory.name} was trained on base model {base!r}; this server "
                f"serves {self.base_model!r} (grail-tinker --model, or --name for the same model "
                "under another name)"
            )
        if create:
            run = self.create(model_id, saved)
        else:
            run = self.known(model_id)
            if saved.shape() != run.spec.shape():
                raise UserFault(
                    f"the checkpoint's LoRA shape (rank {saved.rank}, train_mlp "
                    f"{saved.train_mlp}, train_attn {saved.train_attn}, train_unembed "
                    f"{saved.train_unembed}) differs from this client's (rank {run.spec.rank}, "
                    f"train_mlp {run.spec.train_mlp}, train_attn {run.spec.train_attn}, "
                    f"train_unembed {run.spec.train_unembed}); load it into a new client "
                    "(create_training_client_from_state)"
                )
        assert self.peft is not None
        tensors = load_file(str(directory / ADAPTER_WEIGHTS), device=str(self.device))
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=run.adapter)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise UserFault(
                f"checkpoint {directory.name}: tensors of another model ({unexpected[:3]})"
            )
        for p in run.params:
            p.grad = None
        if optimizer:
            state = torch.load(
                directory / OPTIMIZER_STATE, map_location=self.device, weights_only=True
            )
            run.optimizer.load_state_dict(state["optimizer"])
            run.steps = int(state["steps"])


def read_lora_spec(directory: Path) -> LoraSpec:
    path = directory / LORA_SPEC
    if not path.is_file():
        raise NotFound(f"no grail-tinker checkpoint at {directory} (no {LORA_SPEC})")
    try:
        return LoraSpec(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:
        raise UserFault(f"{path} is not a LoRA spec grail-tinker wrote: {exc}") from exc


def _saved_base_model(directory: Path) -> str | None:
    """The base model a checkpoint's adapter_config.json names (None: it names none)."""
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise UserFault(
            f"checkpoint {directory.name}: unreadable {ADAPTER_CONFIG} ({exc})"
        ) from exc
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return None if base is None else str(base)


def new_seed() -> int:
    return secrets.randbits(31)


def _microbatches(data: list[Datum]) -> Iterator[list[Datum]]:
    """Consecutive datums, at most MICROBATCH_TOKENS padded tokens per batch (one datum at
    least)."""
    batch: list[Datum] = []
    width = 0
    for datum in data:
        w = max(width, len(datum.tokens))
        if batch and w * (len(batch) + 1) > MICROBATCH_TOKENS:
            yield batch
            batch, w = [], len(datum.tokens)
        batch.append(datum)
        width = w
    if batch:
        yield batch
