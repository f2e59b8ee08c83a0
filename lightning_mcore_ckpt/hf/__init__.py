"""Hugging Face export and import through mbridge: names, formats, streaming, validation.

Three operations share one converter (mbridge's name maps and tensor formats for the model
family of ``hf_model_path``):

- :func:`export_checkpoint`: a saved step (any TP/PP/DP layout) to a Hugging Face directory. It
  reads the dist-checkpoint on disk slice by slice (one layer of one weight at a time, all
  tensor-parallel pieces of it), so no process ever holds the whole model, and needs no process
  group: rank 0 runs it in the background during training, the CLI on one CPU process.
- :func:`load_hf_weights`: Hugging Face weights into a live, sharded Megatron-Core model; each
  rank reads only the layers of its pipeline stage and keeps its tensor-parallel part.
- :func:`import_checkpoint`: a Hugging Face directory to a step directory that
  ``trainer.fit(ckpt_path=...)`` (or ``MegatronStrategy(init_from=...)``) takes weights from.

The models converted are Megatron-Core GPT models of the families mbridge maps; a
``HybridModel`` (a step of one, or a LightningModule holding one) is refused before any work, as
mbridge maps no hybrid architecture.

Megatron-Core checkpoints name tensors the way Transformer Engine layers do
(``linear_qkv.layer_norm_weight``) with either layer spec, which are the names mbridge maps; the
local-spec model used on CPU is built here (mbridge's ``get_model`` hard-codes Transformer Engine
and ``.cuda()``).

The modules, each importing only those above it:

- ``_refused``: a refused option's error, Lightning imported only once one is refused (an
  export, an import or a verification in a process of its own needs none of it);
- ``_names``: the Megatron-Core tensor names the conversion relies on;
- ``_heads``: output heads (language model, value, reward) in both formats;
- ``_bridge``: :class:`HFBridge`, :func:`supported_model_types`;
- ``_reader``: a dist-checkpoint read slice by slice, without a process group;
- ``_safetensors``: the streaming safetensors writer, the index, the readers;
- ``_plan``: what an export writes, checked against the Hugging Face config;
- ``_export``: :class:`HFExport`, :func:`export_checkpoint`, :func:`is_exported`;
- ``_load``: :func:`check_model_matches`, :func:`gpt_model_prefixes`, :func:`load_hf_weights`;
- ``_import``: :func:`import_checkpoint`;
- ``_verify``: :func:`verify_export`;
- ``_upload``: :func:`upload_export`, :class:`HubUploader` (the Hub, after a verified export).
"""

from __future__ import annotations

from lightning_mcore_ckpt.hf._bridge import HFBridge, supported_model_types
from lightning_mcore_ckpt.hf._export import HF_DIR, WHEN, HFExport, export_checkpoint, is_exported
from lightning_mcore_ckpt.hf._import import import_checkpoint
from lightning_mcore_ckpt.hf._load import check_model_matches, gpt_model_prefixes, load_hf_weights
from lightning_mcore_ckpt.hf._logits import LOGITS_ATOL, LogitsResult, check_logits
from lightning_mcore_ckpt.hf._plan import DEFAULT_MAX_SHARD_BYTES
from lightning_mcore_ckpt.hf._upload import (
    HubUploader,
    UploadError,
    UploadResult,
    check_upload_options,
    upload_export,
)
from lightning_mcore_ckpt.hf._verify import VerifyResult, verify_export

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "HF_DIR",
    "LOGITS_ATOL",
    "WHEN",
    "HFBridge",
    "HFExport",
    "HubUploader",
    "LogitsResult",
    "UploadError",
    "UploadResult",
    "VerifyResult",
    "check_logits",
    "check_model_matches",
    "check_upload_options",
    "export_checkpoint",
    "gpt_model_prefixes",
    "import_checkpoint",
    "is_exported",
    "load_hf_weights",
    "supported_model_types",
    "upload_export",
    "verify_export",
]
