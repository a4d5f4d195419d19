"""ServerArgs: every engine flag, with SGLang's names, defaults per device, and validation.

`ServerArgs` is the single source of truth for the CLI (`--kebab-case` flags are
generated from the field names), the Python `Engine(**kwargs)` and the HTTP server.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
ATTENTION_BACKENDS = ("torch_native", "cpu_paged", "triton", "flashinfer")  # see layers/attention/registry.py
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "prefix_aware")
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
DISAGGREGATION_MODES = ("null", "prefill", "decode")  # SGLang's spelling: "null" is one engine doing both
TRANSFER_BACKENDS = ("tcp", "mooncake")  # core/disaggregation/transfer.py, mooncake.py (backends.py picks)
HICACHE_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")  # SGLang's
HICACHE_STORAGE_BACKENDS = ("file",)  # an L3 directory (SGLang also has mooncake, hf3fs, nixl)
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


# `--help` of every flag (SGLang's wording where it has the flag). Defaults and choices are added
# by `add_cli_args`; tests/fast/test_cli_help.py checks that no field is left without help.
FLAG_HELP = {
    "model_path": "the model: nothing for the default (SmolLM2-135M-Instruct, embedded GGUF), 'smollm2-135m', "
    "a .gguf file, a local Hugging Face directory, or a Hub id ORG/NAME, downloaded into the Hugging Face cache "
    "(HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE apply; docs/models.md lists the families)",
    "revision": "with --model ORG/NAME: the branch, tag or commit to download (default: main)",
    "download_dir": "with --model ORG/NAME: the Hugging Face cache to download into (default: HF_HUB_CACHE, "
    "else ~/.cache/huggingface/hub)",
    "gguf_file": "with --model ORG/NAME of a GGUF repository: the one .gguf file to download and convert, "
    "e.g. qwen2.5-0.5b-instruct-q8_0.gguf (with a local directory: the .gguf inside it)",
    "served_model_name": "the model name the API reports and accepts (default: derived from the model)",
    "dtype": "weights and activations: auto picks bfloat16 on CPUs with AVX512-BF16/AMX (and on CUDA), else float32",
    "kv_cache_dtype": "KV cache dtype; auto = the model dtype",
    "context_length": "the longest prompt + output a request may have (default: the model's)",
    "device": "where the model runs; auto = cuda if available, else cpu",
    "random_seed": "seed of the sampler (a request's own seed overrides it)",
    "max_total_tokens": "KV pool size in tokens (default: from the memory budget)",
    "kv_cache_memory_gb": "CPU: memory budget of the KV pool in GiB (default 0.5)",
    "mem_fraction_static": "CUDA: fraction of free GPU memory for weights and the KV pool",
    "max_running_requests": "most requests in the running batch at once",
    "simulate": "serve a deployment that is not there: the real tokenizer manager, scheduler and detokenizer "
    "over this hardware's cost model (h100, h200, a100-80g, l4, cpu-here), on a simulated clock; --model may "
    "then name a known model (llama-3.1-70b, qwen3-32b, ...) or an HF config.json (without --model: the default "
    "model's, smollm2-135m), --tp-size counts its devices",
    "trace_token_ids": "the trace (and a --record file) carries each request's prompt and output token ids, so "
    "`workbench sim run --workload FILE` replays the recorded run token for token (shared prefixes included)",
    "sim_speed": "with --simulate: simulated seconds per wall second (1 real time, 10 ten times faster); 0 runs "
    "as fast as this host can and skips idle gaps to the next request a replaying driver announces",
    "stream_interval": "a streaming request's new tokens go out every this many tokens (the first at once); "
    "larger trades smoothness for throughput. Non-streaming requests send every 50, or every token while "
    "a view listens to the trace",
    "max_prefill_tokens": "token budget of one prefill (extend) batch",
    "chunked_prefill_size": "longest prompt piece one step prefills; longer prompts are chunked "
    "(default 2048 on CPU, 8192 on CUDA; -1 or 0 turns chunking off)",
    "schedule_policy": "the order waiting requests are admitted in: "
    + ", ".join(SCHEDULE_POLICIES)
    + " (lpm: longest cached prefix first), or one a plugin registered",
    "schedule_conservativeness": "how much KV room admission keeps for running requests' future tokens "
    "(higher: fewer retractions, smaller batches)",
    "disable_radix_cache": "turn the radix prefix cache off (every prompt computed in full)",
    "disable_overlap_schedule": "run schedule and forward one after the other; --no-disable-overlap-schedule "
    "overlaps the next step's scheduling with the current forward (default: overlapped on CPU when a fixed "
    "--num-threads leaves a core free, else one after the other)",
    "attention_backend": "attention kernels (default: cpu_paged on CPU, flashinfer or triton on CUDA)",
    "disable_cuda_graph": "CUDA: run decode eagerly instead of through captured CUDA graphs",
    "cuda_graph_max_bs": "CUDA: the largest decode batch captured as a graph",
    "cuda_graph_bs": "CUDA: the batch sizes to capture (default: buckets up to --cuda-graph-max-bs)",
    "cuda_graph_stand_in": "CPU: decode through the graph runner with a stand-in graph (tests the GPU path's logic)",
    "enable_torch_compile": "compile the decode step with torch.compile",
    "torch_compile_max_bs": "the largest decode batch torch.compile is used for",
    "num_threads": "CPU compute threads of each scheduler process (default: adaptive, measured against the "
    "neighbours while decoding)",
    "cpu_omp_threads_bind": "pin each scheduler rank to cores, e.g. 0-1, or 0-1|2-3 for two TP ranks "
    "(SGLang's SGLANG_CPU_OMP_THREADS_BIND; 'nobind' leaves them unpinned)",
    "speculative_algorithm": "speculative decoding: NGRAM proposes draft tokens from the request's own prompt "
    "and output (no second model); STANDALONE drafts with --speculative-draft-model-path. The target model "
    "verifies the drafts in one pass per step; the output is what decoding without drafts gives",
    "disaggregation_mode": "disaggregated serving (docs/disaggregation.md): prefill computes prompts and hands "
    "their KV to a decode server, which reserves slots, pulls the KV and decodes; requests reach both through "
    "a PD router (sglang_router --pd-disaggregation) that adds bootstrap_host/port/room; null: one engine does both",
    "disaggregation_bootstrap_port": "prefill: the TCP port decode servers pull KV from (give it to the router "
    "after the prefill URL: --prefill URL PORT)",
    "disaggregation_transfer_backend": "how KV crosses from prefill to decode: tcp (built in: per-layer chunks "
    "over a socket, one machine or two) or mooncake (Mooncake's transfer engine writes the KV into the decode "
    "side's buffer; pip install mooncake-transfer-engine-non-cuda, see docs/disaggregation.md)",
    "disaggregation_transfer_timeout": "decode: seconds to wait for a prompt's KV before the request fails "
    "(and its reserved slots are freed); prefill: how long computed KV is held for a decode server to pull",
    "enable_hierarchical_cache": "HiCache (docs/hicache.md): radix-tree KV evicted from the device pool is kept "
    "in a host-memory pool (L2) and, with --hicache-storage-backend, in storage (L3); a later match loads it "
    "back instead of recomputing it",
    "hicache_ratio": "the host pool's size as a multiple of the device KV pool's (ignored when --hicache-size is set)",
    "hicache_size": "the host pool's size in GB (0: use --hicache-ratio)",
    "hicache_write_policy": "when device KV is copied to the host pool: write_through (as soon as it enters the "
    "tree), write_back (only when it is evicted from the device), write_through_selective (once a node has been "
    "hit at least twice)",
    "hicache_storage_backend": "an L3 tier under the host pool: file (pages as files in "
    "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, default /tmp/hicache; survives a restart)",
    "hicache_storage_prefetch_policy": "when a prefix found in storage is prefetched to the host pool: best_effort "
    "(the request is scheduled with whatever has arrived), wait_complete (it waits for all of it), timeout (it "
    "waits up to a time proportional to the pages)",
    "enable_priority_scheduling": "admit waiting requests by their `priority` (then arrival) and let a waiting "
    "request preempt running ones of lower priority (docs/scheduling.md)",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling: a smaller `priority` value is "
    "more urgent (default: a larger one is)",
    "priority_scheduling_preemption_threshold": "with --enable-priority-scheduling: a waiting request preempts a "
    "running one only when their priorities differ by more than this",
    "enable_deterministic_inference": "the same greedy and seeded outputs whatever the batch a request shares and "
    "whatever prefix is cached (CPU: batch-invariant linears, norms and attention, seeded sampling per "
    "request; slower: `workbench bench deterministic` prints the cost; docs/deterministic.md)",
    "enable_lora": "serve LoRA adapters of the base model beside it: a request names one with `lora_path` "
    "(/generate, Engine.generate) or as `model` = BASE:ADAPTER on the OpenAI routes (docs/lora.md)",
    "lora_paths": "adapters loaded at start-up, each NAME=PATH or PATH (named after its directory): PEFT's format, "
    "adapter_config.json + adapter_model.safetensors (implies --enable-lora)",
    "max_loras_per_batch": "most distinct adapters (the base model counts as none) in one batch; a request whose "
    "adapter would exceed it waits for the next step",
    "max_loaded_loras": "most adapters held in memory at once; loading one more evicts the least recently used "
    "adapter no request is using (default: no limit)",
    "max_lora_rank": "the largest adapter rank accepted (default: the largest of --lora-paths; an adapter loaded "
    "later must not exceed it)",
    "lora_target_modules": "the projections adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj "
    "down_proj, Phi-3's fused qkv_proj gate_up_proj, or all; default: the union of --lora-paths')",
    "speculative_draft_model_path": "STANDALONE: a small draft model with the target's tokenizer",
    "speculative_num_steps": "STANDALONE: draft model passes per step (default: as many as the draft tokens)",
    "speculative_num_draft_tokens": "the most draft tokens verified per request per step (default 4)",
    "speculative_accept_rate": "with --simulate and --speculative-algorithm: the chance the target model agrees "
    "with each draft token (the simulated drafts are not computed; STANDALONE then costs the passes of the "
    "draft model --speculative-draft-model-path names, a known model or an HF config.json)",
    "tp_size": "tensor-parallel ranks (one scheduler process each)",
    "ep_size": "expert parallelism inside the tensor-parallel group: the experts of each mixture-of-experts layer "
    "are split into this many groups of whole experts, each group's intermediate size over tp-size / ep-size "
    "ranks (must divide --tp-size and the number of experts; 1: every rank holds a slice of every expert)",
    "dp_size": "data-parallel replicas of the whole model behind one front end",
    "load_balance_method": "how requests are spread over data-parallel replicas",
    "nnodes": "nodes in a multi-node tensor-parallel launch",
    "node_rank": "this node's rank in a multi-node launch (node 0 runs the front end)",
    "dist_init_addr": "HOST:PORT of node 0 that every node can reach (multi-node TP)",
    "host": "address to bind (127.0.0.1: this machine only)",
    "port": "HTTP port",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health",
    "enable_cors": "answer cross-origin requests from any origin (for a browser front end)",
    "max_request_body_bytes": "largest request body accepted (413 above it)",
    "max_n": "largest n (choices per request) accepted",
    "max_top_logprobs": "largest top_logprobs accepted",
    "tool_call_parser": "how tool calls are read from the model's output (chat `tools`): hermes / qwen25 "
    "(<tool_call> JSON blocks) or llama3 (JSON objects)",
    "trace_publish": "publish the trace over ZMQ PUB at this address (e.g. tcp://127.0.0.1:5557) for "
    "`workbench tui --attach`",
    "record": "write the trace as a JSONL recording to this file",
    "trace_mode": "auto: emit trace events while anything listens; on: always; off: never",
    "otlp_traces_endpoint": "export one OpenTelemetry trace per request to this OTLP/HTTP endpoint, "
    "e.g. http://127.0.0.1:4318/v1/traces",
    "log_level": "log level of the server and its processes",
    "show_progress": "print start-up progress",
}
FLAG_CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "float16"),
    "device": ("auto", "cpu", "cuda"),
    "attention_backend": ATTENTION_BACKENDS,
    "load_balance_method": LOAD_BALANCE_METHODS,
    "trace_mode": ("auto", "on", "off"),
    "tool_call_parser": ("hermes", "qwen25", "llama3"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "disaggregation_mode": DISAGGREGATION_MODES,
    "disaggregation_transfer_backend": TRANSFER_BACKENDS,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
    "hicache_storage_prefetch_policy": HICACHE_PREFETCH_POLICIES,
}


def flag_help(f: dataclasses.Field) -> str:
    """A field's help line with its default (what `--help` shows)."""
    text = f.metadata.get("help") or FLAG_HELP.get(f.name, "")
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(default, bool):
        return text
    return f"{text} (default: {default})" if default is not None else text


@dataclass
class ServerArgs:
    # model
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    revision: str | None = None  # a Hub model's branch, tag or commit
    download_dir: str | None = None  # the Hugging Face cache a Hub model is downloaded into
    gguf_file: str | None = None  # the .gguf file of a GGUF repository on the Hub
    simulate: str | None = None  # a hardware name: a simulated deployment (core/simulation/live.py)
    sim_speed: float = 1.0  # simulated seconds per wall second (0: as fast as possible)
    trace_token_ids: bool = False  # req.tokenized / req.finished carry the token ids
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto = same as dtype
    context_length: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    random_seed: int = 0
    # memory and scheduling
    max_total_tokens: int | None = None  # KV pool size in tokens; None = from the memory budget
    kv_cache_memory_gb: float | None = None  # CPU budget for the KV pool (default 0.5 GiB)
    mem_fraction_static: float = 0.85  # CUDA: fraction of free memory for weights + KV
    max_running_requests: int = 128
    stream_interval: int = 1
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = None  # None = per-device default; -1 or 0 disables
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    # hierarchical KV cache (HiCache): host tier (L2) and storage tier (L3) under the device pool
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB; 0 = by --hicache-ratio
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    # priority scheduling
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    # batch-invariant kernels (SGLang's --enable-deterministic-inference)
    enable_deterministic_inference: bool = False
    # multi-LoRA serving (SGLang's flags; docs/lora.md)
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    # None: the overlap loop when a core is spare beside a fixed thread count (cpu_threads.overlap_by_default)
    disable_overlap_schedule: bool | None = None
    enable_kv_invariant_check: bool = field(
        default=False,
        metadata={
            "help": (
                "check, whenever the scheduler goes idle, that every KV slot is free, cached or held by a request "
                "and every request row and radix lock is accounted for; a violation is logged with the numbers and "
                "reported by get_internal_state (env WORKBENCH_KV_INVARIANT_CHECK=1 turns it on, =0 off)"
            )
        },
    )
    # execution
    attention_backend: str | None = None  # None = cpu_paged (else torch_native) on CPU, flashinfer/triton on CUDA
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 32
    cuda_graph_bs: list[int] | None = None
    cuda_graph_stand_in: bool = False  # CPU: decode through the graph runner with a stand-in graph
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    num_threads: int | None = None  # torch intra-op threads in the scheduler process (None: adaptive)
    cpu_omp_threads_bind: str | None = (
        None  # pin each scheduler rank to cores, e.g. 0-1 or 0-1|2-3 (SGLang's SGLANG_CPU_OMP_THREADS_BIND)
    )
    # speculative decoding
    speculative_algorithm: str | None = None  # NGRAM (drafts from the request's own text) | STANDALONE
    speculative_draft_model_path: str | None = None  # STANDALONE: the small draft model
    speculative_num_steps: int | None = None  # STANDALONE: draft model passes per step
    speculative_num_draft_tokens: int | None = None  # most draft tokens verified per request per step
    speculative_accept_rate: float | None = None  # --simulate: each draft kept with this probability
    # disaggregated prefill/decode (core/disaggregation/)
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "tcp"
    disaggregation_transfer_timeout: float = 60.0
    # parallelism
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    enable_cors: bool = False
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    max_top_logprobs: int = 20
    tool_call_parser: str = "hermes"
    # trace
    trace_publish: str | None = None  # e.g. tcp://127.0.0.1:5557
    record: str | None = None  # write a JSONL recording of the trace
    trace_mode: str = "auto"  # auto: emit while anything listens; on: always; off: never
    otlp_traces_endpoint: str | None = (
        None  # OpenTelemetry spans per request (OTLP/HTTP), e.g. http://127.0.0.1:4318/v1/traces
    )
    log_level: str = "warning"
    show_progress: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a message that says what to change."""

        def bad(msg: str):
            raise ValueError(msg)

        if self.gguf_file is not None and not self.gguf_file.lower().endswith(".gguf"):
            bad(f"--gguf-file names a .gguf file of the repository, not {self.gguf_file!r}")
        if self.sim_speed < 0:
            bad(f"--sim-speed must be 0 (as fast as possible) or a positive factor, not {self.sim_speed}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad(f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad(f"--kv-cache-dtype must be auto, float32, bfloat16 or float16, not {self.kv_cache_dtype!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            from workbench.core.plugins import load_plugins  # only for a name that is not built in

            known = list(SCHEDULE_POLICIES) + [n for n in load_plugins().policies if n not in SCHEDULE_POLICIES]
            if self.schedule_policy not in known:
                bad(
                    f"--schedule-policy must be one of {', '.join(known)} (built in, or registered by a plugin: "
                    f"`workbench plugins` lists them), not {self.schedule_policy!r}"
                )
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            bad(f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            bad("--max-total-tokens must be at least 16")
        if self.stream_interval < 1:
            bad("--stream-interval must be at least 1 (1 sends every token)")
        if self.max_running_requests < 1:
            bad("--max-running-requests must be at least 1")
        if self.max_prefill_tokens < 16:
            bad("--max-prefill-tokens must be at least 16")
        for name in ("tp_size", "ep_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                bad(f"--{name.replace('_', '-')} must be at least 1")
        if self.tp_size % self.ep_size:
            bad(
                f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size}: expert parallelism splits the "
                f"tensor-parallel ranks into groups of whole experts"
            )
        if not 0 <= self.node_rank < self.nnodes:
            bad("--node-rank must be in [0, --nnodes)")
        if self.tp_size % self.nnodes:
            bad(
                f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}: every node runs "
                f"the same number of TP ranks"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            bad(
                "--nnodes > 1 needs --dist-init-addr HOST:PORT, an address of node 0 every node can reach "
                "(the same on every node)"
            )
        if self.dist_init_addr is not None:
            from workbench.core.distributed.topology import split_addr

            split_addr(self.dist_init_addr)  # raises with an example of a good address
        if self.trace_mode not in ("auto", "on", "off"):
            bad("--trace-mode must be auto (trace while a view, recorder or publisher listens), on or off")
        if self.trace_mode == "off" and (self.trace_publish or self.record or self.otlp_traces_endpoint):
            bad(
                "--trace-mode off emits nothing, so --trace-publish / --record / --otlp-traces-endpoint would "
                "stay empty; drop one of them"
            )
        if self.num_threads is not None and self.num_threads < 1:
            bad("--num-threads must be at least 1 (leave it out for the adaptive default)")
        if self.cpu_omp_threads_bind and self.cpu_omp_threads_bind != "nobind":
            from workbench.core.model_executor.cpu_threads import parse_core_list

            groups = self.cpu_omp_threads_bind.split("|")
            for g in groups:
                parse_core_list(g)  # raises with an example of a good list
            if len(groups) != self.tp_size // self.nnodes:
                bad(
                    f"--cpu-omp-threads-bind {self.cpu_omp_threads_bind!r} has {len(groups)} core group(s); this "
                    f"node runs {self.tp_size // self.nnodes} scheduler rank(s): one group each, separated by |"
                )
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in SPECULATIVE_ALGORITHMS:
                bad(
                    f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                    f"not {self.speculative_algorithm!r}"
                )
            self.speculative_algorithm = algo
            if algo == "STANDALONE" and not self.speculative_draft_model_path:
                bad("--speculative-algorithm STANDALONE needs --speculative-draft-model-path (a small model)")
            if algo == "STANDALONE" and self.tp_size > 1 and not self.simulate:
                bad(
                    "--speculative-algorithm STANDALONE runs its draft model beside one scheduler rank: use "
                    "--tp-size 1 (or NGRAM, which needs no second model)"
                )
        if self.enable_deterministic_inference and not self.simulate:
            if self.speculative_algorithm is not None:
                bad(
                    "--enable-deterministic-inference has no batch-invariant verify pass: drop "
                    "--speculative-algorithm (or the flag)"
                )
            if self.enable_torch_compile:
                bad("--enable-deterministic-inference runs its own kernels: drop --enable-torch-compile (or the flag)")
        if self.speculative_accept_rate is not None:
            if not self.simulate or self.speculative_algorithm is None:
                bad(
                    "--speculative-accept-rate is for a simulated engine's drafts: use it with --simulate and "
                    "--speculative-algorithm (a real engine's drafts are accepted or not by its model)"
                )
            if not 0.0 <= self.speculative_accept_rate <= 1.0:
                bad(f"--speculative-accept-rate must be between 0 and 1, not {self.speculative_accept_rate}")
        for name in ("speculative_num_steps", "speculative_num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 64:
                bad(f"--{name.replace('_', '-')} must be between 1 and 64")
        self._validate_disaggregation(bad)
        self._validate_hicache_and_priority(bad)
        self._validate_lora(bad)
        if self.device not in ("auto", "cpu", "cuda"):
            bad("--device must be auto, cpu or cuda")
        if self.cuda_graph_max_bs < 1:
            bad("--cuda-graph-max-bs must be at least 1 (or pass --disable-cuda-graph)")
        if self.cuda_graph_bs is not None and any(b < 1 for b in self.cuda_graph_bs):
            bad("--cuda-graph-bs takes batch sizes of at least 1, e.g. --cuda-graph-bs 1 2 4 8 16")

    def _validate_disaggregation(self, bad) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            bad(
                f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, not {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            bad(
                f"--disaggregation-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}, not "
                f"{self.disaggregation_transfer_backend!r} (nixl is not supported; docs/disaggregation.md)"
            )
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            bad(
                f"--disaggregation-bootstrap-port must be a TCP port (1-65535), not {self.disaggregation_bootstrap_port}"
            )
        if self.disaggregation_transfer_timeout <= 0:
            bad("--disaggregation-transfer-timeout must be a positive number of seconds")
        if self.disaggregation_mode == "null":
            return
        if self.simulate is not None:
            # A simulated PD server (core/simulation/pd_live.py): its clock is paced to the wall clock, so two
            # servers agree on time; one process stands for all of its tp_size devices.
            if self.sim_speed == 0:
                bad(
                    f"--disaggregation-mode {self.disaggregation_mode} with --simulate needs a positive --sim-speed "
                    "(each server's clock follows the wall clock, so the prefill and decode servers agree on time); "
                    "to run a PD deployment as fast as possible: `workbench sim run --pd 1P1D ...`"
                )
            if self.disaggregation_transfer_backend != "tcp":
                bad(
                    "a simulated PD server hands over no KV tensors: use --disaggregation-transfer-backend tcp "
                    "(the link model times each transfer)"
                )
        # What a PD server does not combine with yet: each would need its own handover (docs/disaggregation.md).
        for on, what in (
            (self.tp_size > 1 and self.simulate is None, "--tp-size > 1 (each rank would hand over its own heads)"),
            (self.dp_size > 1, "--dp-size > 1 (run several servers behind the router instead)"),
            (self.speculative_algorithm is not None, "--speculative-algorithm"),
        ):
            if on:
                bad(f"--disaggregation-mode {self.disaggregation_mode} does not combine with {what} yet")

    def _validate_hicache_and_priority(self, bad) -> None:
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            bad(
                f"--hicache-write-policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
                f"not {self.hicache_write_policy!r}"
            )
        if self.hicache_storage_backend is not None and self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            bad(
                f"--hicache-storage-backend must be one of {', '.join(HICACHE_STORAGE_BACKENDS)}, not "
                f"{self.hicache_storage_backend!r} (mooncake, hf3fs and nixl are SGLang's; docs/hicache.md)"
            )
        if self.hicache_storage_prefetch_policy not in HICACHE_PREFETCH_POLICIES:
            bad(
                f"--hicache-storage-prefetch-policy must be one of {', '.join(HICACHE_PREFETCH_POLICIES)}, "
                f"not {self.hicache_storage_prefetch_policy!r}"
            )
        if self.hicache_ratio <= 1.0 and self.hicache_size == 0 and self.enable_hierarchical_cache:
            bad(
                f"--hicache-ratio must be above 1 (the host pool holds the device pool's KV and more), "
                f"not {self.hicache_ratio}"
            )
        if self.hicache_size < 0:
            bad(f"--hicache-size is in GB and must be 0 (use --hicache-ratio) or more, not {self.hicache_size}")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            bad(
                f"--hicache-storage-backend {self.hicache_storage_backend} is HiCache's storage tier: add "
                "--enable-hierarchical-cache"
            )
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            bad("--enable-hierarchical-cache keeps the radix tree's KV in more tiers: drop --disable-radix-cache")
        if self.priority_scheduling_preemption_threshold < 0:
            bad("--priority-scheduling-preemption-threshold must be 0 or more")

    def _validate_lora(self, bad) -> None:
        if self.lora_paths:
            self.enable_lora = True  # SGLang: naming adapters turns LoRA on
            for item in self.lora_paths:
                name, sep, path = item.partition("=")
                if sep and (not name or not path):
                    bad(f"--lora-paths takes NAME=PATH or PATH, not {item!r}")
        if self.max_loras_per_batch < 1:
            bad(f"--max-loras-per-batch must be at least 1, not {self.max_loras_per_batch}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            bad(
                f"--max-loaded-loras ({self.max_loaded_loras}) must be at least --max-loras-per-batch "
                f"({self.max_loras_per_batch}): a batch's adapters are all in memory"
            )
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            bad(f"--max-lora-rank must be at least 1, not {self.max_lora_rank}")

    # ---- resolved values -------------------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_num_draft_tokens(self) -> int:
        """Draft tokens per request per step: 0 without speculative decoding."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_draft_tokens or self.speculative_num_steps or 4

    def resolved_chunked_prefill_size(self) -> int | None:
        """None means chunking is off."""
        if self.chunked_prefill_size is None:
            return 2048 if self.resolved_device() == "cpu" else 8192
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else None

    # ---- CLI -------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add every field as --kebab-case (with --model as an alias of --model-path)."""
        group = parser.add_argument_group("engine and server (ServerArgs; SGLang's flag names)")
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            names = [flag, "--model"] if f.name == "model_path" else [flag]
            default = f.default if f.default is not dataclasses.MISSING else None
            text = flag_help(f)
            if f.type in ("Optional[bool]", "bool | None"):  # three states: --flag, --no-flag, or decided at start-up
                group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
                continue
            if f.type in ("bool",) or isinstance(default, bool):
                if default:
                    group.add_argument(
                        *names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text
                    )
                else:
                    group.add_argument(*names, dest=f.name, action="store_true", default=False, help=text)
                continue
            kind = str(f.type)
            extra = {"choices": FLAG_CHOICES[f.name]} if f.name in FLAG_CHOICES else {}
            if "list[str]" in kind:
                group.add_argument(*names, dest=f.name, type=str, nargs="+", default=default, help=text)
            elif "list[int]" in kind:
                group.add_argument(*names, dest=f.name, type=int, nargs="+", default=default, help=text)
            elif "int" in kind:
                group.add_argument(*names, dest=f.name, type=int, default=default, help=text, **extra)
            elif "float" in kind:
                group.add_argument(*names, dest=f.name, type=float, default=default, help=text, **extra)
            else:
                group.add_argument(*names, dest=f.name, type=str, default=default, help=text, **extra)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def choose_cpu_dtype() -> str:
    """bfloat16 where the CPU has fast bf16 matrix units (AVX512-BF16 / AMX), else float32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
