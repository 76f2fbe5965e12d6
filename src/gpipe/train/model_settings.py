"""The settings of ``gpipe train`` that say what the model is (:class:`ModelSettings`, the first
fields of :class:`~gpipe.train.config.TrainConfig`, which adds how it is trained): which model, its
size, its experts, its normalization and initialization, and the layers it shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpipe.hypergradient import SCOPES  # --lr-hypergradient-scope
from gpipe.models import hf
from gpipe.models.fixup import INIT_SCHEMES  # --init-scheme

__all__ = ["INIT_SCHEMES", "MODELS", "NORMS", "SCOPES", "ModelSettings", "aids_error", "tensor_parallel_error"]

MODELS = ("transformer", "amoebanet", "hf")
NORMS = ("auto", "none")  # --norm: the model's own (layer norm, batch norm), or none


@dataclass(kw_only=True)
class ModelSettings:
    """What the model is; each field is also a flag of ``gpipe train``."""

    model: str = field(
        default="transformer",
        metadata={"help": f"the model: {', '.join(MODELS)} (hf: a Hugging Face causal LM, built from --hf-config)"},
    )
    hf_config: str = field(
        default="",
        metadata={
            "help": "hf: a transformers config.json (or its folder) of a causal LM, read locally, weights random; "
            f"'': a GPT-2 of {hf.DEFAULT['n_layer']} layers, n_embd {hf.DEFAULT['n_embd']}, "
            f"{hf.DEFAULT['n_head']} heads, the data's vocabulary and length"
        },
    )
    init: str = field(
        default="",
        metadata={
            "help": "the weights to start from: a folder save_pretrained wrote (--model hf: its config, weights and "
            "tokenizer, each stage reading its own tensors), or a run or checkpoint of gpipe train (a warm start of "
            "its model: weights only, a new optimizer, steps from 1)"
        },
    )
    lora: int = field(
        default=0,
        metadata={
            "help": "hf: train LoRA adapters of rank R (peft) beside the --lora-targets, the model's own weights "
            "frozen (no gradients, no optimizer state); 0: train every weight"
        },
    )
    lora_targets: str = field(
        default="",
        metadata={
            "help": "--lora: the modules adapted, comma-separated (q_proj,v_proj); '': peft's default for the "
            "model's architecture"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "hf, --data TEXT: a tokenizer.json (or its folder; a tokenizer_config.json beside it must name "
            "its eos_token, which ends every document, and may name a bos_token, which then starts every document) "
            "or a SentencePiece .model to read the text with ('': OUT/vocab.model, trained on the text's lines on "
            "the first run, --vocab-size pieces)"
        },
    )
    layers: int = field(
        default=0,
        metadata={
            "help": "L: encoder layers (as many decoder layers) of the transformer, normal cells of AmoebaNet-D; "
            "0: the model's default (transformer 2, amoebanet 6)"
        },
    )
    hidden: int = field(default=256, metadata={"help": "transformer: H, the feed-forward size"})
    heads: int = field(default=4, metadata={"help": "transformer: A, the attention heads"})
    dim: int = field(default=64, metadata={"help": "transformer: the model dimension"})
    head_dim: int = field(
        default=0,
        metadata={
            "help": "transformer: the width of every attention head (0: dim / heads); the paper's 32-head models "
            "have heads of 64 in a 1024-wide model"
        },
    )
    filters: int = field(default=16, metadata={"help": "amoebanet: D, the filters of the first stack"})
    reference_cells: bool = field(
        default=False,
        metadata={
            "help": "amoebanet: the cells of the TPU reference implementation, which meet the paper's parameter "
            "counts (normal cells also concatenate their input, 4D wide; the reduction's 3x3 a bottleneck)"
        },
    )
    classes: int = field(default=10, metadata={"help": "amoebanet: classes of the synthetic images (--data: its own)"})
    image_size: int = field(
        default=32,
        metadata={"help": "amoebanet: image side of the synthetic images and of a folder's images (.npz keep theirs)"},
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    logit_clip: float = field(default=0.0, metadata={"help": "clip logits to +-this (0: no clipping)"})
    transparent: bool = field(
        default=False,
        metadata={
            "help": "transformer: transparent attention (Bapna et al. 2018), for deep encoders: each decoder layer "
            "attends over its own learned softmax-weighted mix of the source embedding and every encoder layer's "
            "output; the weights are logged at each evaluation as transparent/dec<j>/<source> (emb, enc<i>)"
        },
    )
    experts: int = field(
        default=0,
        metadata={
            "help": "transformer: the feed-forward block of every --moe-every'th encoder and decoder layer is a "
            "sparsely-gated mixture of E experts, gated as GShard (0: dense)"
        },
    )
    expert_top_k: int = field(default=2, metadata={"help": "--experts: the experts each token goes to (GShard: 2)"})
    capacity_factor: float = field(
        default=1.25,
        metadata={
            "help": "--experts: an expert takes at most factor x top-k x positions / E tokens of a micro-batch; the "
            "tokens past it are dropped (carried by the residual)"
        },
    )
    moe_every: int = field(default=2, metadata={"help": "--experts: every N'th layer's feed-forward is a mixture"})
    moe_loss_weight: float = field(
        default=0.01, metadata={"help": "--experts: the weight of the load-balancing loss added to the objective"}
    )
    norm: str = field(
        default="auto",
        metadata={
            "help": "the normalization: auto (the model's own: layer norm in the transformer, batch norm in "
            "AmoebaNet-D) or none (every norm an identity; train it with --init-scheme fixup)"
        },
    )
    init_scheme: str = field(
        default="default",
        metadata={
            "help": "the initialization: default, or fixup (Zhang et al. 2019, with --norm none: every residual "
            "branch's last weights zero, its others scaled by L^-1/2, scalar biases and multipliers)"
        },
    )
    share_layers: int = field(
        default=1,
        metadata={
            "help": "transformer: every N consecutive encoder layers (and decoder layers) use one set of weights "
            "(Universal Transformers' sharing across depth; 1: none); N divides --layers"
        },
    )


def aids_error(cfg: Any) -> str | None:
    """What is wrong with the training aids' settings of ``cfg`` (a ``TrainConfig``), if anything:
    ``--norm``, ``--init-scheme`` (Fixup without normalization, for the paper's models),
    ``--share-layers`` (a divisor of the Transformer's layers, dense) and the learned learning rate's
    scope without ``--lr-hypergradient``."""
    for name, given, choices in (("--norm", cfg.norm, NORMS), ("--init-scheme", cfg.init_scheme, INIT_SCHEMES),
                                 ("--lr-hypergradient-scope", cfg.lr_hypergradient_scope, SCOPES)):  # fmt: skip
        if given not in choices:
            return f"{name} {given!r} is not one of {', '.join(choices)}"
    if cfg.model == "hf" and (cfg.norm != "auto" or cfg.init_scheme != "default"):
        return (
            "--norm and --init-scheme are for the paper's models (transformer, amoebanet); a Hugging Face model "
            "keeps its config's normalization and initialization: leave them out"
        )
    if cfg.init_scheme == "fixup" and cfg.norm != "none":
        return (
            f"--init-scheme fixup trains without normalization (Fixup's scalars and scaled initialization take its "
            f"place), and --norm is {cfg.norm!r}: add --norm none"
        )
    if cfg.share_layers < 1:
        return f"--share-layers must be at least 1 (1: no sharing; got {cfg.share_layers})"
    if cfg.share_layers > 1:
        layers = cfg.depth  # (L, the Transformer's default where --layers is 0)
        if cfg.model != "transformer":
            return f"--share-layers is for --model transformer (model: {cfg.model!r}); leave it out"
        if layers % cfg.share_layers:
            return (
                f"--share-layers {cfg.share_layers} must divide the {layers} encoder (and decoder) layers: every "
                f"{cfg.share_layers} consecutive layers share one set of weights; give a divisor of {layers}"
            )
        if cfg.experts:
            return (
                "--share-layers with --experts is not supported (a mixture of experts' weights are split and "
                "routed per layer); leave one of them out"
            )
    if cfg.lr_hypergradient_scope != "layer" and not cfg.lr_hypergradient:
        return (
            "--lr-hypergradient-scope is for the learned learning rate: give --lr-hypergradient BETA too, or leave "
            "it out"
        )
    return None


def tensor_parallel_error(cfg: Any) -> str | None:
    """What is wrong with ``--tensor-parallel`` for ``cfg``'s model, if anything: the Transformer's
    attention is split by heads, which needs ``--head-dim`` (gpipe's own projections, not
    ``nn.MultiheadAttention``'s fused one) and heads that the degree divides; AmoebaNet-D has no plan."""
    t = cfg.tensor_parallel
    if t <= 1 or cfg.model == "hf":  # (a Hugging Face model's plan is checked as it is split)
        return None
    if cfg.model == "amoebanet":
        return (
            f"--tensor-parallel {t}: AmoebaNet-D has no tensor-parallel plan (it splits the Transformer and --model "
            "hf); use --data-parallel or --partitions"
        )
    if not cfg.head_dim:
        return (
            f"--tensor-parallel {t} splits the Transformer's attention by heads, which nn.MultiheadAttention's fused "
            f"projection cannot be: give --head-dim {max(cfg.dim // max(cfg.heads, 1), 1)} (the same sizes)"
        )
    if cfg.heads % t:
        return f"--tensor-parallel {t} must divide --heads {cfg.heads}: each rank computes heads/T of them"
    return None
