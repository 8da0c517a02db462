"""The `settings` that `generate --json` and `eval` (eval.json) record of a run: every option
that can change its numbers, so that two result files say how their runs differ.

Options are recorded as given, an option left unset as null (its default: `gamma` null verifies
the whole block, `dtype` null computes in the dtypes stored); the engine's sizes are recorded as
they ran, after the defaults that follow the prompts were filled in.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark_jax.checkpoints.converted import DecodingModels
    from dspark_jax.decoding.engine import EngineConfig
    from dspark_jax.decoding.policies import Policy
    from dspark_jax.sampling import SamplingConfig


def decoding_settings(
    args: argparse.Namespace,
    models: DecodingModels,
    cfg: EngineConfig,
    sampling: SamplingConfig,
    policy: Policy | None = None,
) -> dict[str, Any]:
    """Device, models, verification policy, sampling and engine of a decoding run. `policy`:
    the engine's, whose SPS table is recorded when `--sps-table auto` measured it in the run
    (`sps_profiled`; null otherwise: a table given as a file is recorded by its path)."""
    from dspark_jax.cli import SPS_AUTO
    from dspark_jax.decoding.policies import SpsProfile, device_description

    profiled = None
    table = getattr(policy, "sps", None)
    if args.sps_table == SPS_AUTO and isinstance(table, SpsProfile):
        profiled = {"buckets": list(table.buckets), "sps": [float(v) for v in table.sps]}

    drafter = models.drafter
    return {
        "device": device_description(),
        "target": str(models.model_dir),
        "draft": models.drafter_path,
        "drafter_fingerprint": models.drafter_fingerprint,
        "block_size": None if drafter is None else drafter.cfg.block_size,
        "dtype": args.dtype,
        # what each model computed in (--dtype, or as stored)
        "target_dtype": models.target.cfg.dtype,
        "draft_dtype": None if drafter is None else drafter.cfg.model.dtype,
        # the mesh chosen (--mesh or the default), None for one device
        "mesh": dict(models.mesh.shape) if models.mesh is not None else None,
        # null without a drafter: plain decoding verifies nothing
        "policy": None if drafter is None else args.policy,
        "gamma": args.gamma,
        "threshold": args.threshold,
        "sps_table": args.sps_table,
        # the steps/s per token bucket that --sps-table auto measured
        "sps_profiled": profiled,
        "sts": args.sts,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        # {token id: bias}, as the flag and the OpenAI API take it
        "logit_bias": {str(token): bias for token, bias in sampling.logit_bias},
        "allowed_token_ids": list(sampling.allowed_token_ids),
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        # every answer ran to max_new_tokens; no end-of-turn token ended one before min_tokens
        "ignore_eos": args.ignore_eos,
        "min_tokens": args.min_tokens,
        "thinking": args.thinking,
        "stop_tokens": list(models.stop_tokens),
        "max_num_seqs": args.max_num_seqs,
        # the engine's slots: --max-num-seqs capped by the requests, rounded to the mesh
        "num_slots": cfg.num_slots,
        "max_model_len": cfg.max_model_len,
        "kv_pages": cfg.pool_pages,
        "page_size": cfg.page_size,
        "rounds_per_chunk": cfg.rounds_per_chunk,
        "prefill_chunk": cfg.prefill_chunk,
    }
