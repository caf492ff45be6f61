"""Hugging Face adapter of the Llama family (``LlamaForCausalLM``): its config table (read and
written by ``models/hf_config.py``) and tensor names (HF's Llama names, ``models/hf_tensors.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from torch import Tensor

from models.errors import ConfigError
from models.hf_config import (
    DECODER_ROWS,
    FFN_ROW,
    GQA_ROWS,
    HFConfig,
    HFFormat,
    read_hf_args,
    write_hf_config,
)
from models.hf_tensors import LLAMA_HF_LAYER_NAMES, LLAMA_HF_TOP_NAMES
from models.llama.model import LlamaArgs
from models.spec import HFTensorReader

__all__ = ["LLAMA_HF_FORMAT", "LlamaHF"]

LLAMA_HF_FORMAT: HFFormat[LlamaArgs] = HFFormat(
    family="llama",
    model_type="llama",
    architecture="LlamaForCausalLM",
    rows=(*DECODER_ROWS, *GQA_ROWS, FFN_ROW),
    hf_fixed={"attention_bias": False, "mlp_bias": False},
)


class LlamaHF:
    """Hugging Face ``LlamaForCausalLM`` <-> meshwright Llama (config and tensor names).

    Subclasses for other dense decoders (``models.qwen3.Qwen3HF``) change ``hf_format`` and
    ``layer_names``."""

    hf_format: HFFormat[LlamaArgs] = LLAMA_HF_FORMAT
    layer_names: dict[str, str] = LLAMA_HF_LAYER_NAMES  # our name in a block -> HF's (without .weight)

    @property
    def architecture(self) -> str:
        """HF's class name, e.g. ``LlamaForCausalLM``."""
        return self.hf_format.architecture

    @property
    def model_type(self) -> str:
        """config.json's ``model_type``."""
        return self.hf_format.model_type

    @property
    def model_types(self) -> tuple[str, ...]:
        """The ``model_type`` values this adapter reads (one)."""
        return (self.hf_format.model_type,)

    def to_hf_config(
        self, args: LlamaArgs, *, bos_id: Optional[int], eos_id: Optional[int], dtype: str
    ) -> HFConfig:
        """The ``config.json`` of ``args`` in this adapter's format."""
        if args.mup.enable:
            raise ConfigError(
                "model.mup.enable=true has no equivalent in Hugging Face's Llama / Qwen3 (no input, "
                "attention or logit multipliers): the exported model would compute other logits. Export is "
                "refused for µP models."
            )
        if args.qk_norm and "attention.q_norm" not in self.layer_names:
            raise ConfigError(
                "model.qk_norm=true has no equivalent in Hugging Face LlamaForCausalLM (no q/k head norms); "
                "train it as model.family=qwen3 (exported as Qwen3ForCausalLM)."
            )
        return write_hf_config(self.hf_format, args, bos_id=bos_id, eos_id=eos_id, dtype=dtype)

    def args_from_hf_config(self, cfg: HFConfig) -> dict[str, Any]:
        """Our args fields from a HF ``config.json`` (``ConfigError`` for what we cannot represent)."""
        return read_hf_args(cfg, (self.hf_format,))

    def hf_names_of(self, name: str, args: Any = None) -> list[str]:
        """The HF tensor(s) holding our parameter ``name`` (one for Llama)."""
        if name in LLAMA_HF_TOP_NAMES:
            return [LLAMA_HF_TOP_NAMES[name]]
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[-1] == "weight":
            local = ".".join(parts[2:-1])
            if local in self.layer_names:
                return [f"model.layers.{parts[1]}.{self.layer_names[local]}.weight"]
        raise ConfigError(f"parameter {name!r} has no Hugging Face {self.architecture} equivalent.")

    def from_hf_name(self, hf_name: str) -> str:
        """HF tensor name -> ours."""
        for ours, hf in LLAMA_HF_TOP_NAMES.items():
            if hf_name == hf:
                return ours
        parts = hf_name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
            local = ".".join(parts[3:-1])
            for ours, hf in self.layer_names.items():
                if local == hf:
                    return f"layers.{parts[2]}.{ours}.weight"
        raise ConfigError(
            f"Hugging Face tensor {hf_name!r} is not part of a {self.architecture} model meshwright supports "
            "(biases and other architectures are not)."
        )

    def folder_name(self, hf_name: str) -> str:
        """A folder's tensor name as ``hf_names_of`` spells it: the same (one architecture per folder)."""
        return hf_name

    def full_shape(self, name: str, hf_shapes: list[list[int]], args: Any = None) -> list[int]:
        """Our full shape of ``name`` given the shapes of its HF tensors (one, unchanged)."""
        return hf_shapes[0]

    def read_slice(
        self, name: str, index: tuple[slice, ...], reader: HFTensorReader, args: Any = None
    ) -> Tensor:
        """The ``index`` slice of our ``name``, read from the HF files through ``reader.read``."""
        return reader.read(self.hf_names_of(name)[0], index)

    def to_hf_state(self, state: dict[str, Tensor], args: LlamaArgs) -> Iterator[tuple[str, Tensor]]:
        """Our full tensors -> (HF name, tensor); a tied head is written once, as the embedding."""
        for name, tensor in state.items():
            if args.tie_embeddings and name == "output.weight":
                continue
            yield self.hf_names_of(name)[0], tensor

    def from_hf_state(self, hf_state: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
        """HF tensors -> our names (derived buffers such as ``rotary_emb.inv_freq`` skipped)."""
        state = {
            self.from_hf_name(k): v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")
        }
        if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
            state["output.weight"] = state["tok_embeddings.weight"]
        return state
