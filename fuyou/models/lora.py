"""LoRA settings and ``peft``'s LoRA layers in a model skeleton (``fuyou.engine.lora`` trains them).

``peft`` injects its layers into the meta-device skeleton (``inject``). A wrapped linear layer's
base weight is then named ``…q_proj.base_layer.weight``, which is ``…q_proj.weight`` in the
Hugging Face checkpoint and in the store (``base_key``). Its LoRA weights (``is_lora``) are not
part of any streamed block.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from torch import nn

from fuyou.errors import ConfigError

ADAPTER = "default"
"""The adapter name inside ``peft``'s layers."""


@dataclass(frozen=True)
class LoraSettings:
    """``--lora-rank/--lora-alpha/--lora-dropout/--lora-targets``."""

    rank: int
    alpha: int
    """Scaling numerator: the adapters' output is multiplied by alpha / rank."""
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all-linear",)
    """Module names (``peft``'s ``target_modules``), matched against the model's linear layers;
    ``all-linear``: every linear layer but the output head."""
    seed: int = 0
    """Seed of the adapters' initialisation (``--seed``)."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.rank, int) or self.rank < 1:
            problems.append(f"--lora-rank must be an integer ≥ 1, got {self.rank!r}")
        if not isinstance(self.alpha, int) or self.alpha < 1:
            problems.append(f"--lora-alpha must be an integer ≥ 1, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            problems.append(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            problems.append("--lora-targets names no module")
        if problems:
            raise ConfigError("; ".join(problems))

    def peft_config(
        self, base: str | None = None, modules: list[str] | None = None, exclude: list[str] | None = None
    ) -> Any:
        """The ``peft.LoraConfig`` of these settings (``modules``: the adapted modules' full names instead
        of ``--lora-targets``, for a base in which those names also match modules Fuyou does not train;
        ``exclude``: module names left out, ``not_linear_maps``)."""
        from peft import LoraConfig

        targets = "all-linear" if self.targets == ("all-linear",) else list(self.targets)
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            exclude_modules=exclude or None,
            target_modules=modules if modules is not None else targets,
            base_model_name_or_path=base,
            task_type="CAUSAL_LM",
        )


def is_lora(name: str) -> bool:
    """Whether a parameter name (``named_parameters``) is a LoRA weight."""
    return ".lora_" in name or name.startswith("lora_")


def base_key(name: str) -> str:
    """The Hugging Face key of a base parameter inside a ``peft`` layer (``q_proj.base_layer.weight``
    → ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".").replace("base_layer.", "")


def not_linear_maps(model: nn.Module) -> list[str]:
    """The names (last component) of ``model``'s linear layers with a ``forward`` of their own — Llama 4's
    router returns its scores and logits — which LoRA cannot adapt (its update is added to a linear map's
    output: peft's wrapper fails on theirs, in ``transformers`` itself too). ``all-linear`` leaves them out."""
    own = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward
    }
    return sorted(own)


def excluded(model: nn.Module, never: tuple[str, ...] = ()) -> list[str]:
    """The linear layers LoRA leaves out of ``model`` (``peft``'s ``exclude_modules``): ``not_linear_maps`` by
    name, and by full name each one whose weight a glob in ``never`` names (``families.untrained``)."""
    untrained = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(fnmatch.fnmatchcase(f"{n}.weight", g) for g in never)
    ]
    return not_linear_maps(model) + untrained


def inject(model: nn.Module, settings: LoraSettings, never: tuple[str, ...] = ()) -> nn.Module:
    """Wrap ``model``'s target linear layers with ``peft``'s LoRA layers, in place (meta device), all but
    ``not_linear_maps`` and those whose weight a glob in ``never`` names (``families.untrained``: layers the
    family computes without gradient, DeepSeek-V3.2's and GLM-5's indexers, whose adapters would never train).

    Raises ConfigError when no module matches ``settings.targets``, naming the model's linear layers, or
    when a target is one of ``not_linear_maps``.
    """
    from peft import inject_adapter_in_model

    exclude = excluded(model, never)
    named = sorted(set(settings.targets) & {e for e in exclude if "." not in e})  # the not_linear_maps
    if named:
        raise ConfigError(
            f"--lora-targets names {', '.join(named)}: a linear layer whose forward returns more than its output "
            "(a router), which LoRA cannot adapt; leave it out"
        )
    try:
        return inject_adapter_in_model(settings.peft_config(exclude=exclude), model, adapter_name=ADAPTER)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"--lora-targets {','.join(settings.targets)} matches no layer of this model ({str(e).splitlines()[0][:120]}); "
            f"its linear layers are {', '.join(names)}"
        ) from None
