"""What a tensor-parallel layout must satisfy, as pure functions: used by the flags' validation, the
model runner and the launcher alike (so neither of the first two imports the process launcher).
"""

from __future__ import annotations


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ValueError saying what a good address looks like."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT (e.g. 10.0.0.1:29500), not {addr!r}")
    return host.strip("[]"), int(port)


def validate_tp_for_model(hf_config, tp_size: int) -> None:
    """Reject a TP size that cannot split this model's heads / MLP evenly, naming sizes that can."""
    if tp_size == 1:
        return
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(getattr(hf_config, "intermediate_size", 0) or 0)
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads")
    if kv_heads % tp_size:
        problems.append(f"{kv_heads} key/value heads")
    if inter and inter % tp_size:
        problems.append(f"MLP width {inter}")
    if problems:
        ok = [
            n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0 and (not inter or inter % n == 0)
        ]
        raise ValueError(
            f"--tp-size {tp_size} does not divide this model's {' and '.join(problems)}; "
            f"each rank must hold whole heads. Use --tp-size one of {ok}"
        )


def tp_ranks_on_node(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The TP ranks node `node_rank` runs."""
    per_node = tp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)
