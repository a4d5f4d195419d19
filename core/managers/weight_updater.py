"""Live weight updates on a running ModelRunner (SGLang's `update_weights_*` family).

Everything here runs in the scheduler process (every TP rank), between two
scheduler steps; the TokenizerManager has already held new requests and let the
running ones finish, and the scheduler flushes the radix cache afterwards.

Weights are named as in HF checkpoints (`model.layers.0.self_attn.q_proj.weight`),
whatever our model fuses or shards: `weight_specs` maps each HF name to the
parameter holding it (qkv_proj, gate_up_proj, a TP shard) and to the full shape
the caller must send. Every update is checked whole (names, shapes, dtypes)
before a single parameter is written, so a rejected update leaves the old
weights in place:

- `update_weights_from_disk(runner, path)`: a checkpoint of the same
  architecture (validated from the safetensors headers, then streamed in);
- `update_weights_from_tensor(runner, named_tensors)`: tensors handed over in
  process (they arrive as bytes, see `encode_named_tensors`);
- `init_weights_update_group` / `update_weights_from_distributed` /
  `destroy_weights_update_group`: a trainer (rank 0 of its own process group,
  never torch.distributed's default group, which tensor parallelism may use)
  broadcasts each tensor in order; every server rank receives and keeps its shard.
  `TrainerWeightSync` is the trainer's side;
- `get_weights_by_name(runner, name)`: read a weight back (for checking).

Dtypes: any floating dtype is accepted and cast to the model's dtype (checkpoints
are often stored in another precision); integer, boolean or quantized tensors are
rejected.
"""

from __future__ import annotations

import datetime
import difflib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from workbench.core.distributed.custom_group import destroy_custom_process_group, init_custom_process_group
from workbench.core.distributed.parallel_state import all_gather_bytes, tensor_model_parallel_all_gather
from workbench.core.io_struct import (
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReqOutput,
    Msg,
    NamedTensorPayload,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    UpdateWeightsReqOutput,
)
from workbench.core.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from workbench.core.layers.vocab_parallel_embedding import VocabParallelEmbedding

if TYPE_CHECKING:
    from workbench.core.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = [
    "WeightUpdateError",
    "WeightSpec",
    "UpdateResult",
    "TrainerWeightSync",
    "weight_specs",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "get_weights_by_name",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "encode_named_tensors",
    "decode_named_tensors",
    "handle_request",
]

# timeout_s of a weight-update group: how long joining may wait for the trainer, and how long each later
# broadcast may wait for it. The join runs beside the scheduler's loop (weight_sync.py), but a broadcast runs
# between two steps with new requests held, so a trainer that stops mid-push stalls serving this long at most:
# hence the bound. 300 s is ample for a trainer to come (they call init at the same time) and for one tensor
# to cross a slow link; the default is what a trainer starting alongside needs.
DEFAULT_GROUP_TIMEOUT_S = 120.0
MAX_GROUP_TIMEOUT_S = 300.0
FLOAT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_IGNORED = ("rotary_emb.inv_freq",)  # derived buffers some checkpoints carry
# Config fields that must agree for a checkpoint to fit the running model.
_STRUCTURE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
_MAX_LISTED = 5


class WeightUpdateError(ValueError):
    """An update was rejected before any weight changed; the message says why."""


@dataclass(frozen=True)
class WeightSpec:
    """Where one HF-named weight lives in our model.

    param_name/shard_id: our parameter and the part of it (q/k/v, gate 0/up 1) the
    HF tensor fills, as `load_weights` uses them. full_shape: the shape a caller
    sends (the unsharded HF tensor). split_dim: the dimension TP ranks split it
    along (None: every rank holds all of it). local_offset/local_size: this
    rank's slice of the fused parameter along dim 0 (fused parts only).
    """

    hf_name: str
    param_name: str
    shard_id: Any
    full_shape: tuple[int, ...]
    split_dim: int | None
    local_offset: int = 0
    local_size: int = -1


@dataclass
class UpdateResult:
    """What a successful update did; `source` goes into the `weights.updated` trace event."""

    source: str
    num_tensors: int
    seconds: float

    @property
    def message(self) -> str:
        return f"updated {self.num_tensors} tensors from {self.source} in {self.seconds:.2f} s"


# ==== the HF-name view of a model =========================================================


def weight_specs(model: torch.nn.Module) -> dict[str, WeightSpec]:
    """HF name -> WeightSpec for every weight of `model` (tied `lm_head.weight` included)."""
    stacked = getattr(model, "stacked_params", ())
    specs: dict[str, WeightSpec] = {}
    for pname, param in model.named_parameters():
        owner = model.get_submodule(pname.rsplit(".", 1)[0])
        tp = getattr(owner, "tp_size", 1)
        leaf = pname.rsplit(".", 1)[1]
        parts = [(part, shard) for fused, part, shard in stacked if f".{fused}." in pname]
        if parts:
            offset = 0
            for part, shard in parts:
                rows = _fused_part_rows(owner, shard) // tp
                fused = next(f for f, p, _ in stacked if p == part)
                name = pname.replace(fused, part)
                specs[name] = WeightSpec(name, pname, shard, (rows * tp, *param.shape[1:]), 0, offset, rows)
                offset += rows
            if offset != param.shape[0]:
                raise RuntimeError(f"{pname}: fused parts cover {offset} of {param.shape[0]} rows")
            continue
        full, split = tuple(param.shape), None
        if isinstance(owner, VocabParallelEmbedding):
            full, split = (owner.num_embeddings, *param.shape[1:]), 0
        elif isinstance(owner, RowParallelLinear) and leaf == "weight":
            full, split = (param.shape[0], param.shape[1] * tp), 1
        elif isinstance(owner, ColumnParallelLinear):
            full, split = (param.shape[0] * tp, *param.shape[1:]), 0
        specs[pname] = WeightSpec(pname, pname, None, full, split if tp > 1 else None)
    if getattr(model, "tie_word_embeddings", False) and "lm_head.weight" not in specs:
        embed = next((s for s in specs.values() if s.hf_name.endswith("embed_tokens.weight")), None)
        if embed is not None:
            specs["lm_head.weight"] = embed
    return specs


def _fused_part_rows(owner: torch.nn.Module, shard: Any) -> int:
    """Rows of the full (all-ranks) HF tensor that fills fused part `shard` of `owner`."""
    if isinstance(owner, QKVParallelLinear):
        heads = owner.num_heads if shard == "q" else owner.num_kv_heads
        return heads * owner.head_dim * owner.tp_size
    if isinstance(owner, MergedColumnParallelLinear):
        return owner.output_sizes[shard]
    raise RuntimeError(f"{type(owner).__name__} is not a fused projection")


def _tied_alias(model: torch.nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model, "tie_word_embeddings", False))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def check_weights(
    model: torch.nn.Module,
    metas: Iterable[tuple[str, Sequence[int], Any]],
    specs: dict[str, WeightSpec] | None = None,
) -> dict[str, WeightSpec]:
    """Check (name, shape, dtype) triples against `model`; raise WeightUpdateError listing the problems.

    Returns the specs of the accepted names. Nothing is read or written.
    """
    specs = specs if specs is not None else weight_specs(model)
    model_dtype = _dtype_name(next(model.parameters()).dtype)
    unknown, bad_shape, bad_dtype, seen, dup = [], [], [], set(), []
    accepted: dict[str, WeightSpec] = {}
    for name, shape, dtype in metas:
        if any(tag in name for tag in _IGNORED):
            continue
        if name in seen:
            dup.append(name)
        seen.add(name)
        spec = specs.get(name)
        if spec is None:
            unknown.append(name)
            continue
        if tuple(int(d) for d in shape) != spec.full_shape:
            bad_shape.append(f"{name} has shape {list(shape)}, the model expects {list(spec.full_shape)}")
        dname = _dtype_name(dtype)
        if dname not in FLOAT_DTYPES:
            bad_dtype.append(f"{name} has dtype {dname}")
        accepted[name] = spec
    problems = []
    if unknown:
        hint = difflib.get_close_matches(unknown[0], list(specs), n=1)
        problems.append(
            f"{len(unknown)} name(s) the model does not have: {_listed(unknown)}"
            + (f" (did you mean {hint[0]}?)" if hint else f" (weights use HF names, e.g. {next(iter(specs))})")
        )
    if bad_shape:
        problems.append(f"{len(bad_shape)} shape mismatch(es): {_listed(bad_shape)}")
    if bad_dtype:
        problems.append(
            f"{len(bad_dtype)} unsupported dtype(s): {_listed(bad_dtype)}; the model is "
            f"{model_dtype} and takes floating-point tensors ({', '.join(FLOAT_DTYPES)})"
        )
    if dup:
        problems.append(f"name(s) sent twice: {_listed(dup)}")
    if problems:
        raise WeightUpdateError("weight update rejected, the old weights are unchanged: " + "; ".join(problems))
    return accepted


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


# ==== loading =================================================================================


@torch.no_grad()
def _load(runner, named: Iterable[tuple[str, torch.Tensor]], source: str, t0: float) -> UpdateResult:
    """Load already-validated tensors through the model's own `load_weights`, then re-derive packed copies."""
    model = runner.model
    tied = bool(getattr(model, "tie_word_embeddings", False))
    embed_name = next((n for n in weight_specs(model) if n.endswith("embed_tokens.weight")), None) if tied else None
    count = 0

    def renamed() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, tensor in named:
            if any(tag in name for tag in _IGNORED):
                continue
            if embed_name is not None and name == "lm_head.weight":
                # load_weights skips a tied head (the embedding is loaded); an explicit push means it.
                name = embed_name
            count += 1
            yield name, tensor.to(runner.device)

    try:
        loaded = model.load_weights(renamed())
        _repack(model, loaded)
    except Exception as exc:
        raise RuntimeError(
            f"loading from {source} failed after validation ({type(exc).__name__}: {exc}); "
            "the weights may be partially updated: load a full checkpoint again"
        ) from exc
    return UpdateResult(source=source, num_tensors=count, seconds=time.perf_counter() - t0)


def _repack(model: LlamaForCausalLM, loaded: set[str]) -> None:
    """The CPU fast path runs on packed copies of the weights: rebuild the ones that changed."""
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    pack = any(m.cpu_fast_path for m in linears)
    for module in model.modules():  # tables derived from the weights (the fused decode's) are rebuilt
        drop = getattr(module, "drop_derived_tables", None)
        if drop is not None:
            drop()
    owners = {name.rsplit(".", 1)[0] for name in loaded}
    head_owner = next((n for n, m in model.named_modules() if m is model.lm_head), "lm_head")
    if head_owner in owners or "lm_head" in owners:
        model.process_weights_after_loading(pack=pack)  # the head's packed copy lives on the model
        return
    for owner_name in owners:
        owner = model.get_submodule(owner_name)
        if isinstance(owner, LinearBase):
            owner.process_weights_after_loading(pack=owner.cpu_fast_path)


def update_weights_from_disk(runner, model_path: str) -> UpdateResult:
    """Load a checkpoint of the running model's architecture in place (all weights, or nothing)."""
    from safetensors import safe_open
    from workbench.core.model_loader import iter_weights, prepare_model
    from workbench.core.model_loader.hf_loader import list_safetensors

    t0 = time.perf_counter()
    prepared = prepare_model(model_path, progress=False)
    _check_same_model(runner, prepared, model_path)
    metas = []
    for path in list_safetensors(prepared.model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                metas.append((name, sl.get_shape(), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype())))
    model = runner.model
    specs = weight_specs(model)
    accepted = check_weights(model, metas, specs)
    covered = {s.param_name + f"#{s.shard_id}" for s in accepted.values()}
    missing = sorted(
        n for n, s in specs.items() if s.param_name + f"#{s.shard_id}" not in covered and not _tied_alias(model, n)
    )
    if missing:
        raise WeightUpdateError(
            f"{model_path} lacks {len(missing)} weight(s) the model has: {_listed(missing)}; "
            "update_weights_from_disk loads complete checkpoints (use "
            "update_weights_from_tensor for a partial update); the old weights are unchanged"
        )
    # A tied checkpoint may still carry lm_head.weight; load_weights skips it as at start-up.
    weights = ((n, t) for n, t in iter_weights(prepared.model_dir, progress=False) if not _tied_alias(model, n))
    return _load(runner, weights, f"disk:{model_path}", t0)


def _check_same_model(runner, prepared, model_path: str) -> None:
    from workbench.core.layers.rotary_embedding import rope_config

    ours = runner.model_config.hf_config
    arch = runner.model_config.architecture
    if prepared.architecture != arch:
        raise WeightUpdateError(
            f"{model_path} is a {prepared.architecture}; the running model is a {arch}. "
            "update_weights_from_disk loads checkpoints of the same architecture; "
            "restart the server to serve another model"
        )
    theirs = prepared.config
    diffs = []
    for key in _STRUCTURE_KEYS:
        a, b = _config_value(ours, key), _config_value(theirs, key)
        if a != b:
            diffs.append(f"{key} {b} (running: {a})")
    if rope_config(ours) != rope_config(theirs):
        diffs.append(f"RoPE {rope_config(theirs)} (running: {rope_config(ours)})")
    if abs(float(ours.rms_norm_eps) - float(theirs.rms_norm_eps)) > 1e-12:
        diffs.append(f"rms_norm_eps {theirs.rms_norm_eps} (running: {ours.rms_norm_eps})")
    if diffs:
        raise WeightUpdateError(
            f"{model_path} has a different shape of {arch}: {'; '.join(diffs)}. "
            "Only checkpoints of the same configuration can be loaded in place"
        )


def _config_value(config, key: str):
    value = getattr(config, key, None)
    if key == "head_dim" and not value:
        value = config.hidden_size // config.num_attention_heads
    if key == "num_key_value_heads" and not value:
        value = config.num_attention_heads
    return value


def update_weights_from_tensor(runner, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> UpdateResult:
    """Load the given HF-named tensors (any subset of the weights); all are checked first."""
    t0 = time.perf_counter()
    check_weights(runner.model, [(n, t.shape, t.dtype) for n, t in named_tensors])
    return _load(runner, named_tensors, "tensor", t0)


@torch.no_grad()
def get_weights_by_name(runner, name: str, truncate_size: int = 100) -> list[float]:
    """The first `truncate_size` values (flattened, as floats) of a weight.

    `name` is an HF name (fused parts are cut out of qkv_proj / gate_up_proj, TP shards
    gathered: every TP rank must call this) or one of our own parameter names (read as is,
    this rank's shard).
    """
    model = runner.model
    spec = weight_specs(model).get(name)
    if spec is None:
        own = dict(model.named_parameters()).get(name)
        if own is None:
            hint = difflib.get_close_matches(name, list(weight_specs(model)), n=1)
            raise WeightUpdateError(f"no weight named {name!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))
        return own.detach().flatten()[:truncate_size].float().tolist()
    param = model.get_parameter(spec.param_name)
    local = param.detach()
    if spec.shard_id is not None:
        local = local.narrow(0, spec.local_offset, spec.local_size)
    owner = model.get_submodule(spec.param_name.rsplit(".", 1)[0])
    if spec.split_dim is not None and getattr(owner, "tp_size", 1) > 1:
        local = tensor_model_parallel_all_gather(local.contiguous(), dim=spec.split_dim)
    if isinstance(owner, VocabParallelEmbedding):
        local = local[: owner.num_embeddings]  # drop the rows padding the vocab to the TP size
    return local.flatten()[:truncate_size].float().tolist()


# ==== tensors as bytes (in-process push without pickle) =======================================


def encode_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[NamedTensorPayload]:
    """Tensors -> msgspec payloads (raw bytes + dtype + shape)."""
    out = []
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        # numpy has no bfloat16: move the bytes as uint8.
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out.append(NamedTensorPayload(name=name, dtype=_dtype_name(t.dtype), shape=list(t.shape), data=data))
    return out


def decode_named_tensors(payloads: Sequence[NamedTensorPayload]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `encode_named_tensors`; rejects a dtype it does not know or a byte count that lies."""
    out = []
    for p in payloads:
        dtype = getattr(torch, p.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightUpdateError(f"{p.name}: unknown dtype {p.dtype!r}")
        numel = 1
        for d in p.shape:
            numel *= int(d)
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if len(p.data) != expected:
            raise WeightUpdateError(
                f"{p.name}: {len(p.data)} bytes for shape {p.shape} {p.dtype} (expected {expected})"
            )
        flat = torch.frombuffer(bytearray(p.data), dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
        out.append((p.name, flat.view(dtype).reshape(p.shape)))
    return out


# ==== the distributed path ====================================================================


@dataclass
class WeightsUpdateGroup:
    """A process group private to weight sync (never torch.distributed's default group)."""

    name: str
    rank: int
    world_size: int
    backend: str
    device: torch.device
    pg: Any


_GROUPS: dict[str, WeightsUpdateGroup] = {}
_JOINING: set[str] = set()  # groups whose join is still running (weight_sync.py)


def _still_joining(group_name: str) -> str:
    return (
        f"weight-update group {group_name!r} is still forming: wait for init_weights_update_group's answer "
        "(it comes when the trainer has joined, or after timeout_s)"
    )


def check_group_timeout(timeout_s: Any) -> float:
    """`timeout_s` as a float in (0, MAX_GROUP_TIMEOUT_S]; WeightUpdateError (a ValueError, so a 400) otherwise."""
    try:
        value = float(timeout_s)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value <= MAX_GROUP_TIMEOUT_S:  # a NaN fails this too
        raise WeightUpdateError(
            f"timeout_s must be more than 0 and at most {MAX_GROUP_TIMEOUT_S:g} s, not {timeout_s!r}: it bounds "
            "how long the join waits for the trainer and how long each broadcast may hold new requests; "
            f"start the trainer's side at the same time (the default is {DEFAULT_GROUP_TIMEOUT_S:g} s)"
        )
    return value


def group_device(backend: str, rank: int, world_size: int) -> torch.device:
    """Check `backend` and `rank`; the device the group's tensors live on (call it on the thread that
    will broadcast: the current CUDA device is per thread)."""
    if backend not in ("gloo", "nccl"):
        raise WeightUpdateError(f"backend must be gloo (CPU) or nccl (CUDA), not {backend!r}")
    if not 0 <= rank < world_size:
        raise WeightUpdateError(f"rank {rank} is outside the world of {world_size} ranks")
    if backend == "nccl":
        import torch.distributed as dist

        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise WeightUpdateError("backend nccl needs CUDA and a torch built with NCCL; use gloo on CPU")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
) -> WeightsUpdateGroup:
    """Host (rank 0, the trainer) or join the group the way OpenRLHF's and SGLang's trainers build it.

    Blocks until every rank has joined or `timeout_s` has passed (WeightUpdateError saying what to check).
    """
    if device is None:
        device = group_device(backend, rank, world_size)
    elif device.type == "cuda":
        torch.cuda.set_device(device)  # a joining thread starts on device 0
    init_method = f"tcp://{master_address}:{int(master_port)}"
    try:
        pg = init_custom_process_group(
            backend, init_method, world_size, rank, group_name, datetime.timedelta(seconds=timeout_s)
        )
    except ValueError as exc:  # ours (custom_group): the address or port cannot be used
        raise WeightUpdateError(
            f"weight-update group {group_name!r} at {init_method}: {exc}; nothing was changed"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - torch raises several types; the user needs one message
        who = "its ranks" if rank == 0 else "the trainer (rank 0) and the other ranks"
        raise WeightUpdateError(
            f"weight-update group {group_name!r} did not form within {timeout_s:g} s at {init_method} "
            f"(this side: rank {rank} of world_size {world_size}, {backend}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. Check that {who} join at the same time with the same "
            "master address and port, group_name, backend and world_size (the trainer's ranks plus one per TP "
            "rank of every engine); nothing was changed"
        ) from exc
    return WeightsUpdateGroup(group_name, rank, world_size, backend, device, pg)


def _broadcast(group: WeightsUpdateGroup, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    # `src` is a rank of this group: its rank map is the identity (see custom_group).
    dist.broadcast(tensor, src=0, group=group.pg)


def check_join(
    runner, rank_offset: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> tuple[int, float, torch.device]:
    """Everything init_weights_update_group checks before joining: (this rank, timeout_s, device).

    Checked on every TP rank alike, before any joins, so no rank is left half-joined.
    """
    if group_name in _GROUPS:
        raise WeightUpdateError(f"weight-update group {group_name!r} already exists; destroy it first")
    if runner.device != "cuda" and backend == "nccl":
        raise WeightUpdateError("backend nccl needs the model on CUDA; use gloo on CPU")
    timeout_s = check_group_timeout(timeout_s)
    tp_size = getattr(runner, "tp_size", 1)
    if world_size < rank_offset + tp_size:
        raise WeightUpdateError(
            f"world_size {world_size} cannot hold this server's {tp_size} TP rank(s) from "
            f"rank_offset {rank_offset}: use world_size >= {rank_offset + tp_size} "
            "(the trainer's ranks plus one per TP rank)"
        )
    rank = rank_offset + runner.tp_rank
    return rank, timeout_s, group_device(backend, rank, world_size)


def init_weights_update_group(
    runner,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> str:
    """Join the trainer's group as rank `rank_offset + tp_rank`; blocks until every rank has joined.

    In-process use; the scheduler joins beside its loop instead (weight_sync.py), so serving goes on.
    """
    rank, timeout_s, device = check_join(runner, rank_offset, world_size, group_name, backend, timeout_s)
    _GROUPS[group_name] = make_group(
        master_address, master_port, rank, world_size, group_name, backend, timeout_s, device
    )
    return joined_message(group_name, rank, world_size, backend)


def joined_message(group_name: str, rank: int, world_size: int, backend: str) -> str:
    return f"joined weight-update group {group_name!r} as rank {rank} of {world_size} ({backend})"


def update_weights_from_distributed(
    runner,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str = "weight_update_group",
) -> UpdateResult:
    """Receive each tensor by broadcast from rank 0, in order, then load them all.

    Checked first (nothing is received if a name, shape or dtype is wrong: the trainer's
    broadcast then waits until its timeout). Everything is received before anything is
    loaded, so a broken connection leaves the old weights in place.
    """
    t0 = time.perf_counter()
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    group = _GROUPS.get(group_name)
    if group is None and group_name in _JOINING:
        raise WeightUpdateError(_still_joining(group_name))
    if group is None:
        raise WeightUpdateError(
            f"no weight-update group named {group_name!r}: call init_weights_update_group "
            f"first (groups: {sorted(_GROUPS) or 'none'})"
        )
    check_weights(runner.model, zip(names, shapes, dtypes))
    received = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        buf = torch.empty([int(d) for d in shape], dtype=FLOAT_DTYPES[_dtype_name(dtype)], device=group.device)
        _broadcast(group, buf)
        received.append((name, buf))
    return _load(runner, received, f"distributed:{group_name}", t0)


def destroy_weights_update_group(group_name: str = "weight_update_group") -> str:
    """Leave and free a weight-update group."""
    if group_name in _JOINING:
        raise WeightUpdateError(_still_joining(group_name))
    group = _GROUPS.pop(group_name, None)
    if group is None:
        raise WeightUpdateError(f"no weight-update group named {group_name!r}")
    _shutdown(group)
    return f"destroyed weight-update group {group_name!r}"


def _shutdown(group: WeightsUpdateGroup) -> None:
    try:
        destroy_custom_process_group(group.pg)
    except Exception:  # noqa: BLE001 - tearing down; nothing to recover
        logger.debug("destroying weight-update group %r failed", group.name, exc_info=True)
    group.pg = None


class TrainerWeightSync:
    """The trainer's side of a weight-update group: rank 0, hosting the store.

    Construct it while the server runs `init_weights_update_group(master_address, master_port,
    rank_offset=1, world_size, group_name)` (both block until all ranks join), then call
    `broadcast(named_tensors)` while the server runs `update_weights_from_distributed` with
    `TrainerWeightSync.describe(named_tensors)`.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ):
        self.group = make_group(master_address, master_port, 0, world_size, group_name, backend, timeout_s)

    @staticmethod
    def describe(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict:
        """`names`, `dtypes`, `shapes` for the server's `update_weights_from_distributed`."""
        return {
            "names": [n for n, _ in named_tensors],
            "dtypes": [_dtype_name(t.dtype) for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
        }

    def broadcast(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> float:
        """Send each tensor, in order, to every server rank; returns the seconds it took."""
        if self.group.pg is None:
            raise RuntimeError("this TrainerWeightSync is closed")
        t0 = time.perf_counter()
        for _, tensor in named_tensors:
            _broadcast(self.group, tensor.detach().to(self.group.device).contiguous())
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.group.pg is not None:
            _shutdown(self.group)

    def __enter__(self) -> TrainerWeightSync:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ==== the scheduler's entry point ===============================================================

WEIGHT_MESSAGES = (
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    InitWeightsUpdateGroupReq,
    UpdateWeightsFromDistributedReq,
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
)
_CHANGES_WEIGHTS = (UpdateWeightsFromDiskReq, UpdateWeightsFromTensorReq, UpdateWeightsFromDistributedReq)


def handle_request(runner, msg: Msg, busy: bool = False) -> tuple[Msg, str | None]:
    """Answer one weight message in the scheduler; never raises.

    Returns (reply, source): source is set when the weights changed (the scheduler then
    flushes its cache, bumps the weights version and emits `weights.updated`). `busy`:
    requests are still running, so weight changes are refused (the TokenizerManager
    normally waits for them first). Under tensor parallelism every rank runs this for
    the same message and they agree on the outcome (only rank 0's reply is sent).
    """
    reply, source = _handle_on_this_rank(runner, msg, busy)
    # Every reply but a GetWeightsByName one is an UpdateWeightsReqOutput.
    if getattr(runner, "tp_size", 1) > 1 and isinstance(reply, UpdateWeightsReqOutput):
        reply, source = _agree_across_ranks(reply, source)
    return reply, source


def _agree_across_ranks(reply: UpdateWeightsReqOutput, source: str | None) -> tuple[Msg, str | None]:
    """One outcome for all TP ranks: a failure on any rank fails the call, naming the rank(s).

    When the weights changed on any rank, `source` is set on every rank, so that all flush
    their caches together (their schedules must stay identical).
    """
    mine = (b"1" if reply.success else b"0") + (b"1" if source is not None else b"0") + reply.message.encode()
    outcomes = all_gather_bytes(mine)
    failed = [(rank, o[2:].decode(errors="replace")) for rank, o in enumerate(outcomes) if o[:1] != b"1"]
    changed_anywhere = any(o[1:2] == b"1" for o in outcomes)
    source = (source or "partial") if changed_anywhere else None
    if not failed:
        return reply, source
    messages = sorted({m for _, m in failed})
    if len(failed) == len(outcomes) and len(messages) == 1:
        text = messages[0]  # the usual case: every rank rejected it alike
    else:
        text = "; ".join(f"TP rank {r}: {m}" for r, m in failed)
    if changed_anywhere:
        text += " (other ranks loaded it: the ranks now disagree; load a full checkpoint again)"
    return type(reply)(success=False, message=text), source


def _handle_on_this_rank(runner, msg: Msg, busy: bool) -> tuple[Msg, str | None]:
    if isinstance(msg, GetWeightsByNameReq):
        try:
            return GetWeightsByNameReqOutput(values=get_weights_by_name(runner, msg.name, msg.truncate_size)), None
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return GetWeightsByNameReqOutput(message=_describe(exc)), None
    try:
        if isinstance(msg, InitWeightsUpdateGroupReq):  # the scheduler joins in weight_sync.py instead
            text = init_weights_update_group(
                runner,
                msg.master_address,
                msg.master_port,
                msg.rank_offset,
                msg.world_size,
                msg.group_name,
                msg.backend,
                msg.timeout_s,
            )
            return InitWeightsUpdateGroupReqOutput(success=True, message=text), None
        if isinstance(msg, DestroyWeightsUpdateGroupReq):
            return UpdateWeightsReqOutput(success=True, message=destroy_weights_update_group(msg.group_name)), None
        if not isinstance(msg, _CHANGES_WEIGHTS):
            return UpdateWeightsReqOutput(success=False, message=f"unexpected message {type(msg).__name__}"), None
        if busy:
            return UpdateWeightsReqOutput(
                success=False,
                message=(
                    "requests are still running; update weights through the Engine / TokenizerManager, which "
                    "waits for them (or aborts them with abort_all_requests=True)"
                ),
            ), None
        if isinstance(msg, UpdateWeightsFromDiskReq):
            result = update_weights_from_disk(runner, msg.model_path)
        elif isinstance(msg, UpdateWeightsFromTensorReq):
            result = update_weights_from_tensor(runner, decode_named_tensors(msg.tensors))
        else:
            result = update_weights_from_distributed(runner, msg.names, msg.dtypes, msg.shapes, msg.group_name)
        logger.info("weights: %s", result.message)
        return UpdateWeightsReqOutput(success=True, message=result.message), result.source
    except Exception as exc:  # noqa: BLE001 - the scheduler must keep serving
        if not isinstance(exc, ValueError) and type(exc).__name__ != "ModelLoadError":
            logger.exception("weight update failed")
        return UpdateWeightsReqOutput(success=False, message=_describe(exc)), None


def _describe(exc: BaseException) -> str:
    from workbench.core.model_loader import ModelLoadError

    if isinstance(exc, (ValueError, ModelLoadError)):  # messages written for the user already
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
