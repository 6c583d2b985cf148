"""EngineArgs: every engine option, defined once.

`LLM(**kwargs)` and the `met` command line are both built from these fields: the CLI flags are
generated from the dataclass (name, type, default, help, choices), so an option cannot drift
between the two. Frozen configs are derived from it once, at startup.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field

from metrale.config.errors import OptionError
from metrale.config.json_object import json_object
from metrale.config.quantization import SUPPORTED_METHODS
from metrale.config.mtp_drafts import default_mtp_drafts
from metrale.config.speculative_config import SpeculativeConfig


def option(default, help: str, choices: tuple | None = None, flag: str | None = None, parse=None,
           aliases: tuple[str, ...] = ()):
    """One option. `aliases`: other names it answers to (vLLM's, the reference system's), as
    keyword arguments and, with dashes, as flags; a name of one letter or two after a dash is a
    flag only ("-tp")."""
    metadata = {"help": help, "choices": choices, "flag": flag, "parse": parse, "aliases": aliases}
    return field(default=default, metadata=metadata)


def int_or_auto(value: str | int) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def kv_skip_layers(spec: str) -> frozenset[int]:
    try:
        return frozenset(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"kv_cache_dtype_skip_layers must be comma-separated layer indices, got {spec!r}") from None


# max_num_batched_tokens=auto (EngineArgs.step_token_budget says why the CPU's is smaller).
CUDA_STEP_TOKEN_BUDGET = 8192
CPU_STEP_TOKEN_BUDGET = 512


@dataclass
class EngineArgs:
    model: str | None = option(None, "Hugging Face model directory (config.json, *.safetensors, tokenizer); "
                                        "default: demo, the built-in demo model")
    tokenizer: str | None = option(None, "Tokenizer directory, if not the model's")
    skip_tokenizer_init: bool = option(False, "Do not load a tokenizer; prompts must be token ids")
    trust_remote_code: bool = option(False, "vLLM's option, refused when true: met never runs a checkpoint's code")
    generation_config: str = option("auto", "Sampling defaults for what a request leaves unset: auto: the model's "
                                            "generation_config.json (temperature, top_p, top_k, min_p, "
                                            "repetition_penalty, max_new_tokens), as vLLM does; vllm: none; or a "
                                            "directory holding a generation_config.json")
    dtype: str = option("auto", "Weight and activation dtype; auto: the checkpoint's on CUDA, float32 on CPU",
                        choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("auto", "Where the model runs; auto: CUDA when available", choices=("auto", "cpu", "cuda"))
    seed: int = option(0, "Seed of the engine; requests without a seed draw theirs from it")
    load_format: str = option("auto", "auto/safetensors: read the checkpoint; dummy: random weights from the "
                                      "config alone (benchmarks)", choices=("auto", "safetensors", "dummy"))
    hf_overrides: str | dict = option("", "JSON object of config.json fields to replace, e.g. "
                                          "'{\"num_hidden_layers\": 4}' (a smaller model of the same shapes)",
                                      parse=str)
    max_model_len: int | None = option(None, "Context length (prompt + output); default: the model's",
                                       aliases=("max_seq_len",))
    max_num_seqs: int | str = option(256, "Most requests running at once; auto: from the memory plan",
                                     parse=int_or_auto, aliases=("max_batch_size",))
    max_num_batched_tokens: int | str = option("auto", "Token budget of one step (prefill chunks + decodes); auto: "
                                                        "8192 on CUDA, 512 on the CPU, where a step's time bounds how "
                                                        "soon an abort or a new request lands", parse=int_or_auto)
    block_size: int = option(16, "Tokens per KV cache block")
    num_kv_blocks: int | None = option(None, "Fix the KV pool's size in blocks; default: from the memory budget")
    kv_cache_memory: int | None = option(None, "Bytes for the KV pool; default: from --gpu-memory-utilization "
                                               "on CUDA, 2 GiB on CPU")
    gpu_memory_utilization: float = option(0.9, "Share of the GPU's memory the server may use")
    attention_backend: str = option("auto", "Attention implementation; auto: triton on CUDA, torch on CPU",
                                    choices=("auto", "torch", "triton"))
    enforce_eager: bool = option(False, "Never capture CUDA graphs (the same as --forward eager on CUDA)")
    prefill_graphs: bool = option(True, "With CUDA graphs: also capture graphs of one fresh prompt of up to 1024 "
                                        "tokens (dense models on the Triton attention backend), so its first "
                                        "token does not wait for the prefill's kernels to be launched one by one")
    quantization: str | None = option(None, "Run the weights quantized: fp8 quantizes an unquantized checkpoint's "
                                            "linear and expert weights to FP8 as they load (per output channel, in "
                                            "groups of 128 inputs); a checkpoint's own quantization_config is read "
                                            "without it (block FP8)")
    activation_quantization: str = option("dynamic", "FP8 models: dynamic quantizes activations per token and "
                                                     "group of 128 features for the FP8 GEMMs (W8A8); none keeps "
                                                     "them in the model dtype (W8A16: exact to the dequantized "
                                                     "weights, slower above batch 4)", choices=("dynamic", "none"))
    lm_head_dtype: str = option("auto", "Element type of the LM head's weight and of the logits; auto: the model "
                                        "dtype, as the reference system keeps it. float32 costs a float32 copy of "
                                        "the head (its own copy where the embeddings are tied)",
                                choices=("auto", "float32", "bfloat16", "float16"))
    forward: str = option("auto", "The executor: graphs: CUDA graphs over the fast (Triton) kernels; eager: the "
                                  "fast kernels without graphs; reference: the PyTorch backends everywhere; auto: "
                                  "graphs on CUDA (eager with --enforce-eager), reference on the CPU",
                          choices=("auto", "graphs", "eager", "reference"))
    async_scheduling: bool | None = option(None, "Plan step N+1 while step N runs on the device (its sampled tokens "
                                                  "feed step N+1 on the device); default: on with CUDA, where it overlaps "
                                                  "the host's work with the GPU's")
    programmatic_launch: bool | None = option(None, "Launch the Triton kernels with programmatic dependent launch, so "
                                                     "each starts while the one before it drains; default: on with "
                                                     "compute capability 9.0 or newer (Hopper), where it exists")
    oom_watchdog_mib: int = option(1024, "On GPU: exit (status 1) when free device memory stays below this many "
                                         "MiB for 3 readings 2 s apart; 0 turns the watchdog off")
    enable_prefix_caching: bool = option(True, "Reuse the KV of full blocks shared with earlier requests")
    structured_outputs_timeout: float = option(10.0, "Seconds a request's grammar (JSON schema, regex, choice, EBNF) "
                                                     "may take to compile; one that takes longer is refused (400)")
    kv_cache_dtype: str = option("auto", "KV cache element type; auto: the model dtype; fp8: e4m3 with "
                                         "per-layer scales", choices=("auto", "float32", "bfloat16", "float16", "fp8"))
    kv_cache_dtype_skip_layers: str = option("", "Comma-separated layer indices whose KV cache stays in the model "
                                                 "dtype when --kv-cache-dtype fp8 (e.g. 0,1,35)")
    fp8_kv_calibration_tokens: int = option(0, "With --kv-cache-dtype fp8 and no k_scale/v_scale in the checkpoint: "
                                               "calibrate the scales at startup over this many tokens (0: scales 1.0)")
    fp8_kv_headroom: float = option(1.2, "Calibrated fp8 scales cover the largest value seen times this factor")
    indexer_cache_dtype: str = option("auto", "Element type of the DSA indexer's key cache (DeepSeek-V3.2, GLM-5); "
                                              "auto: the model dtype; fp8: e4m3 keys with one float32 scale per "
                                              "token (refused for models without an indexer)",
                                      choices=("auto", "bfloat16", "fp8"))
    ssm_h_dtype: str = option("float32", "Element type of the recurrent state of linear-attention (Gated DeltaNet) "
                                         "layers; it is always computed in float32",
                              choices=("float32", "bfloat16", "float16"))
    state_checkpoint_slots: int | str = option("auto", "Per-request states of hybrid (linear-attention) models kept "
                                                       "at block-aligned prompt positions, so that a prefix-cache hit "
                                                       "resumes from one; auto: max_num_seqs // 4, at least 8; 0 turns "
                                                       "prefix caching off for such models", parse=int_or_auto)
    # Fetching media for image_url / video_url parts (docs/multimodal.md, "Fetching media: the policy").
    allowed_media_domains: str | tuple = option("", "Comma-separated host names that media URLs may name (exact "
                                                    "match, any port); empty: any host that resolves to public "
                                                    "addresses only", parse=str)
    allowed_local_media_path: str | None = option(None, "Directory whose files file:// media URLs may read (symlinks "
                                                        "resolved; none may lead out); default: file:// refused")
    media_allow_http: bool = option(False, "Fetch media over plain http too; default: https only")
    media_allow_private_addresses: bool = option(False, "UNSAFE: fetch media from loopback, private, link-local and "
                                                        "other non-public addresses (cloud metadata, internal "
                                                        "services); for tests on loopback only")
    media_max_bytes: int = option(20 << 20, "Largest image a media URL may hold, in bytes (fetched, data: or file://)")
    media_max_video_bytes: int = option(256 << 20, "Largest video a media URL may hold, in bytes")
    media_fetch_timeout: float = option(10.0, "Seconds one media fetch may take in all (DNS, redirects, the body); "
                                              "connecting and each read wait at most 5 s of it")
    media_max_image_pixels: int = option(64 << 20, "Largest image (width x height, read from its header before it "
                                                   "is decoded) and video frame accepted")
    # Images and video (docs/multimodal.md).
    limit_mm_per_prompt: str | dict = option("", "JSON object of the most media items one prompt may carry, per "
                                                 "modality, e.g. '{\"image\": 4, \"video\": 1}'; default: 16 "
                                                 "images and 2 videos", parse=str)
    mm_processor_kwargs: str | dict = option("", "JSON object of processor defaults for every request: max_pixels, "
                                                 "min_pixels (per image or frame), fps, max_frames (video); a "
                                                 "request's own mm_processor_kwargs override them", parse=str)
    vision_max_pixels: int | None = option(None, "Cap on the pixels of an image or video frame after resizing (the "
                                                 "processor's max_pixels is lowered to it, never raised)")
    max_num_encoder_tokens: int | None = option(None, "Vision encoder output rows one step may compute (the encoder "
                                                      "budget; also the runner's encoder cache size); default: "
                                                      "max_num_batched_tokens, at least the largest image's tokens")
    # Parallelism (docs/parallel.md). world = tp x ep (orthogonal mesh) or tp = ep = world (overlapping).
    tp_size: int = option(1, "Tensor-parallel ranks", aliases=("tensor_parallel_size", "-tp"))
    ep_size: int = option(1, "Expert-parallel ranks (MoE models)")
    enable_expert_parallel: bool = option(False, "vLLM's switch: the MoE experts are spread over the tensor-parallel "
                                                 "ranks (--ep-size = --tp-size) instead of sliced")
    pipeline_parallel_size: int = option(1, "vLLM's option; met has no pipeline parallelism: 1 only")
    world_size: int = option(1, "Ranks in all, across hosts; derived from --tp-size and --ep-size when 1")
    rank: int = option(0, "This process's global rank (multi-host launches)")
    master_addr: str = option("127.0.0.1", "Address of rank 0's rendezvous")
    master_port: int = option(29500, "Port of rank 0's rendezvous")
    allow_remote_ranks: bool = option(False, "Let ranks on other hosts join through a non-loopback --master-addr; "
                                             "they authenticate with the secret of --rank-secret-file or "
                                             "MET_RANK_SECRET (docs/parallel.md)")
    rank_secret_file: str | None = option(None, "File holding the secret the ranks of a multi-host run share (or "
                                                "set MET_RANK_SECRET); one-host runs draw their own")
    moe_expert_layout: str = option("ep", "ep: each EP rank holds a range of experts; tp: every expert's "
                                          "intermediate dimension is sliced over the TP ranks", choices=("ep", "tp"))
    all_reduce_oneshot_max_kb: int = option(0, "CUDA all-reduces of at most this many KiB use a one-shot "
                                                "symmetric-memory path, larger ones NCCL's; 0: always NCCL's")
    speculative_config: str | dict = option("", "JSON object of speculative decoding, named as vLLM names it: "
                                                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                                "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}' "
                                                "(docs/speculative.md)", parse=str)
    speculative: bool = option(False, "Draft with the model's own MTP / next-n layers: speculative_config "
                                      "'{\"method\": \"mtp\"}', k from --num-drafts (default: the model "
                                      "family's, docs/speculative.md)")
    num_drafts: int | None = option(None, "Tokens a drafter proposes per step (speculative_config's "
                                          "num_speculative_tokens when that leaves it out)")
    spec_cost_model: str | None = option(None, "How many drafts a step verifies: static: num_speculative_tokens "
                                               "every step; measured: per step, from --spec-cost-calibration's "
                                               "table, the batch size and the acceptance seen (0 where drafting "
                                               "does not pay); default: speculative_config's cost_model, else "
                                               "static")
    spec_cost_calibration: str | None = option(None, "The table `met benchmark spec-cost-table` wrote, read by "
                                                     "--spec-cost-model measured")

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size}: met has no pipeline parallelism; "
                             "split the model with tensor_parallel_size (and expert parallelism for MoE) instead")
        if self.trust_remote_code:
            raise ValueError("trust_remote_code=True is refused: met never runs code from a checkpoint; it "
                             "implements each supported architecture itself (README, 'Supported today')")
        if self.enable_expert_parallel:
            if self.ep_size not in (1, self.tp_size):
                raise ValueError(f"enable_expert_parallel sets ep_size to tp_size ({self.tp_size}); "
                                 f"do not also give ep_size {self.ep_size}")
            self.ep_size = self.tp_size
        self.max_num_seqs = int_or_auto(self.max_num_seqs)
        self.max_num_batched_tokens = int_or_auto(self.max_num_batched_tokens)
        self.state_checkpoint_slots = int_or_auto(self.state_checkpoint_slots)
        if self.state_checkpoint_slots != "auto" and self.state_checkpoint_slots < 0:
            raise ValueError(f"state_checkpoint_slots must be >= 0, got {self.state_checkpoint_slots}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tp_size", "ep_size", "world_size"):
            if getattr(self, name) != "auto" and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.fp8_kv_headroom < 1.0:
            raise ValueError(f"fp8_kv_headroom must be at least 1.0, got {self.fp8_kv_headroom}")
        if self.fp8_kv_calibration_tokens < 0:
            raise ValueError(f"fp8_kv_calibration_tokens must be >= 0, got {self.fp8_kv_calibration_tokens}")
        kv_skip_layers(self.kv_cache_dtype_skip_layers)  # validates
        if self.quantization in ("", "none"):
            self.quantization = None
        if self.quantization is not None and self.quantization not in SUPPORTED_METHODS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_METHODS)} (block FP8 checkpoints load without it, from their "
                             f"quantization_config)")
        self.config_overrides  # validates
        if self.speculative:
            if self.speculative_config:
                raise ValueError("--speculative drafts with the model's MTP layers (speculative_config "
                                 "'{\"method\": \"mtp\"}'); do not give --speculative-config too")
            self.speculative_config = {"method": "mtp"}
        self.speculative_decoding  # validates
        for name in ("media_max_bytes", "media_max_video_bytes", "media_max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"media_fetch_timeout must be > 0, got {self.media_fetch_timeout}")
        self.media_limits, self.processor_defaults  # validate
        if self.vision_max_pixels is not None and self.vision_max_pixels < 1:
            raise ValueError(f"vision_max_pixels must be at least 1, got {self.vision_max_pixels}")
        if self.max_num_encoder_tokens is not None and self.max_num_encoder_tokens < 1:
            raise ValueError(f"max_num_encoder_tokens must be at least 1, got {self.max_num_encoder_tokens}")
        if not self.structured_outputs_timeout > 0:
            raise ValueError(f"structured_outputs_timeout must be > 0, got {self.structured_outputs_timeout}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")

    @property
    def config_overrides(self) -> dict:
        """`hf_overrides` as a dict (given as one, or as a JSON object on the command line)."""
        return _json_object(self.hf_overrides, "hf_overrides")

    @property
    def media_limits(self) -> dict:
        """`limit_mm_per_prompt` as {modality: count}."""
        limits = _json_object(self.limit_mm_per_prompt, "limit_mm_per_prompt")
        for key, value in limits.items():
            if key not in ("image", "video"):
                raise ValueError(f"limit_mm_per_prompt: unknown modality {key!r} (image, video)")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"limit_mm_per_prompt: {key} must be an integer >= 0, got {value!r}")
        return limits

    @property
    def processor_defaults(self) -> dict:
        """`mm_processor_kwargs` as a dict (its keys are checked by the processor, by name)."""
        kwargs = _json_object(self.mm_processor_kwargs, "mm_processor_kwargs")
        unknown = sorted(set(kwargs) - {"max_pixels", "min_pixels", "fps", "max_frames"})
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown key(s) {', '.join(unknown)} (max_pixels, min_pixels, "
                             f"fps, max_frames)")
        return kwargs

    @property
    def speculative_decoding(self) -> SpeculativeConfig | None:
        """`speculative_config` (a dict, or a JSON object on the command line) parsed, or None."""
        return SpeculativeConfig.parse(self.speculative_config, self.num_drafts, self.spec_cost_model,
                                       self.spec_cost_calibration,
                                       mtp_default_drafts=default_mtp_drafts(self.model, self.config_overrides))

    @property
    def kv_cache_skip_layers(self) -> frozenset[int]:
        return kv_skip_layers(self.kv_cache_dtype_skip_layers)

    def schedules_asynchronously(self, device_type: str) -> bool:
        """--async-scheduling as asked, or by default: on with CUDA (engine.py refuses it where a
        drafter proposes on the host from the step before)."""
        return self.async_scheduling if self.async_scheduling is not None else device_type == "cuda"

    def step_token_budget(self, device_type: str) -> int:
        """`max_num_batched_tokens` on this device. On the CPU a step's matmuls are compute-bound
        from a few hundred rows on, so a larger step gains no throughput (the demo model and a
        100M-parameter one were as fast or faster at 512 than at 8192), while every step runs to
        its end before an abort, a newcomer's first chunk or the running decodes move on: at 8192 a
        prefill step of the demo model took seconds on one core (docs/server.md, "Abort latency")."""
        if self.max_num_batched_tokens != "auto":
            return self.max_num_batched_tokens
        return CUDA_STEP_TOKEN_BUDGET if device_type == "cuda" else CPU_STEP_TOKEN_BUDGET

    # -- other names --------------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """EngineArgs from keyword arguments that may use an option's aliases (vLLM's names)."""
        canonical = {}
        for name, value in kwargs.items():
            target = _ALIAS_OF.get(name, name)
            if target in canonical:
                raise OptionError(f"{name} and {target} name the same option; give one")
            canonical[target] = value
        unknown = sorted(set(canonical) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise OptionError(f"unknown option(s): {', '.join(unknown)} (see docs/compatibility.md for the "
                              f"vLLM names met takes)")
        try:
            return cls(**canonical)
        except ValueError as e:
            raise OptionError(str(e)) from None

    # -- the command line, generated from the fields -------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        group = parser.add_argument_group("engine options")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            flags = [flag] + [a if a.startswith("-") else "--" + a.replace("_", "-")
                              for a in f.metadata.get("aliases", ())]
            base = _base_type(f.type)
            kwargs = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
            if base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata.get("parse") or base
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
            group.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in vars(namespace).items() if k in names})
        except ValueError as e:
            raise OptionError(str(e)) from None


def _json_object(value: str | dict, name: str) -> dict:
    """An option given as a dict or a JSON object; an empty string is {}."""
    return {} if isinstance(value, str) and not value.strip() else json_object(value, name)


def _base_type(annotation) -> type:
    """`int | None` -> int, `str` -> str (annotations are strings under `from __future__`)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing}, {})  # our own literal annotations only
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


# alias -> field name, for keyword arguments ("-tp"-style names are flags only).
_ALIAS_OF = {alias: f.name for f in dataclasses.fields(EngineArgs) for alias in f.metadata.get("aliases", ())
             if not alias.startswith("-")}
