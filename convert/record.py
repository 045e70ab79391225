"""What a conversion writes beside the weights: config.json, the model card (README.md),
gqakit_convert.json (the settings and facts; the calibration record), the side files
copied from the source, and the one-line drift summary of a calibrated conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gqakit
from gqakit.convert.plan import Plan
from gqakit.convert.resolved import ResolvedSettings
from gqakit.convert.source import Opened
from gqakit.core import arch as archmod
from gqakit.core.arch import SITE_NAMES
from gqakit.core.hub import hub_id_of
from gqakit.core.loading import CONVERT_SETTINGS, REMOTE_PREFIX
from gqakit.core.methods import changed_projections, load
from gqakit.core.modelcard import render_model_card, use_it_body
from gqakit.core.modelfiles import side_files
from gqakit.core.units import DTYPE_BYTES, config_dtype, kv_bytes_text


QUALITY_SIGNAL = ("residual drift: the relative distance ‖h' − h‖ / ‖h‖ between the converted and the original "
                  "model's hidden states on calibration text after each layer (0 = identical). It is the "
                  "conversion's own quality signal: the larger the drift after the last layer, the further "
                  "the perplexity before uptraining is from the original's (docs/benchmarks.md pairs them)")


def output_config(plan: Plan, settings: ResolvedSettings,
                  query_orders: dict[int, list[int] | None] | None = None) -> dict[str, Any]:
    """config.json of the output. `query_orders`: each layer's query head order (`AttnHeads.q_order`),
    recorded where the model's position scheme follows the head index (`ArchSpec.position_bias_on`)."""
    cfg = dict(plan.config)
    spec = archmod.registry()[plan.family]
    if spec.position_bias_on(plan.config):
        cfg[archmod.QUERY_HEAD_ORDER] = query_head_order(plan, query_orders or {})
    if per_layer_family(plan, settings) is not None:
        cfg = per_layer_config(plan, settings, cfg)
    elif plan.native_gqa:
        cfg[spec.config.num_kv_heads or "num_key_value_heads"] = settings.num_kv_heads
        if spec.remote is not None and cfg.get("model_type") == f"gqakit_{spec.family}":
            # a per-layer source in the modeling file's layout, a uniform output: the stock folder
            cfg.pop(spec.config.kv_heads_list or "", None)
            cfg.update(model_type=spec.model_types[0], architectures=[spec.architectures[0]])
    else:
        from gqakit.convert.remote import remote_config_updates

        if spec.config.kv_heads_list:  # the family's own layout: one count in every layer, no list
            cfg.pop(spec.config.kv_heads_list, None)
        enc = plan.encoder_shape
        encoder_kv = None if enc is None else settings.num_kv_heads if "encoder" in plan.sites else enc.num_kv_heads
        cfg.update(remote_config_updates(plan.family, settings.num_kv_heads, encoder_kv_heads=encoder_kv))
    if settings.dtype is not None:
        cfg["dtype"] = settings.dtype
        cfg.pop("torch_dtype", None)
    if plan.native_gqa and per_layer_family(plan, settings) is None:
        cfg.pop("auto_map", None)  # stock class: any source remote code does not apply
    cfg.pop("_name_or_path", None)
    return cfg


def per_layer_family(plan: Plan, settings: ResolvedSettings) -> str | None:
    """The family whose layout the output is written in when its layers' KV heads differ (or
    the source's already did), or None: the source family's own layout."""
    spec = archmod.registry()[plan.family]
    if settings.per_layer:
        return spec.per_layer_kv
    if plan.shape.kv_heads_per_layer is not None:  # a uniform output of a per-layer source
        return None if plan.native_gqa else spec.per_layer_kv  # native: the stock folder
    # a family whose layout always states its layers' heads (not as an optional list) keeps it
    return spec.per_layer_kv if spec.family == spec.per_layer_kv and not spec.config.kv_heads_list else None


def own_layout_config(plan: Plan, settings: ResolvedSettings, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json of a family whose own modeling file takes each layer's KV heads as a list
    (the table's `config.kv_heads_list`): the family's GQA config, `num_key_value_heads` the
    largest layer's, and the list where the layers differ."""
    from gqakit.convert.remote import remote_config_updates

    spec = archmod.registry()[plan.family]
    assert spec.config.kv_heads_list is not None
    out = {**cfg, **remote_config_updates(plan.family, settings.num_kv_heads)}
    heads = [settings.kv_heads_at(L) for L in range(plan.shape.num_layers)]
    out.pop(spec.config.kv_heads_list, None)
    if len(set(heads)) > 1:  # one count in every layer: num_key_value_heads alone, as -g writes it
        out[spec.config.kv_heads_list] = heads
    return out


def per_layer_config(plan: Plan, settings: ResolvedSettings, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json in the per-layer layout (the table's `per_layer_kv` family: model type,
    class, `auto_map` to its modeling file, and per layer `block_configs[i]` with the attention's
    query heads per KV head and the FFN width; or, for a family that is its own per-layer
    layout, `own_layout_config`). A source already in that layout keeps its FFN entries."""
    from gqakit.convert.layout import layer_names

    family = per_layer_family(plan, settings)
    assert family is not None
    target, spec, s = archmod.registry()[family], archmod.registry()[plan.family], plan.shape
    if target.config.kv_heads_list:
        return own_layout_config(plan, settings, cfg)
    assert target.remote is not None
    module = target.remote.module or f"gqakit_modeling_{family}"
    planned = {p.name for p in plan.tensors}
    names = layer_names(spec, 0)
    before = cfg.get("block_configs") if spec.family == family else None
    hidden = int(cfg.get(spec.config.hidden_size) or s.hidden_size)
    blocks = []
    for L in range(s.num_layers):
        g = settings.kv_heads_at(L)
        if before:
            ffn = dict(before[L]["ffn"])
        else:
            width = int(cfg["intermediate_size"])
            ffn = {"intermediate_size": width, "no_op": False, "replace_with_linear": False}
            mult = 1.5 * width / hidden  # DeciLM's ffn_mult, written only where it gives the width exactly
            if width % 256 == 0 and int(2 * mult * hidden / 3) == width:
                ffn["ffn_mult"] = mult
        blocks.append({"attention": {"n_heads_in_group": s.num_heads // g, "no_op": False,
                                     "replace_with_linear": False}, "ffn": ffn})
    out = {k: v for k, v in cfg.items() if k != "auto_map"}
    out.update({"num_key_value_heads": settings.num_kv_heads,  # the largest layer's, as the config class holds it
                "model_type": target.model_types[0], "architectures": [target.architectures[0]],
                "auto_map": {"AutoConfig": f"{module}.{target.remote.config_class}",
                             "AutoModelForCausalLM": f"{module}.{target.remote.model_class}"},
                "block_configs": blocks, "head_dim": s.head_dim,
                "attention_bias": bool(cfg.get("attention_bias")) or f"{spec.attention.prefix.format(layer=0)}"
                f"{spec.attention.o}.bias" in planned, "qkv_bias": names.get("q.bias") in planned})
    return out


def query_head_order(plan: Plan, orders: dict[int, list[int] | None]) -> list[list[int]]:
    """Per layer, the source index of each query head of the output: the source's own order
    composed with the conversion's (a source converted before may carry one already)."""
    H, layers = plan.shape.num_heads, plan.shape.num_layers
    before = plan.config.get(archmod.QUERY_HEAD_ORDER) or [list(range(H))] * layers
    return [[before[L][i] for i in (orders.get(L) or range(H))] for L in range(layers)]


def copy_side_files(opened: Opened, tmp: Path) -> list[str]:
    copied = []
    if opened.gguf:  # the tokenizer lives inside the GGUF file
        from gqakit.core.loading import load_tokenizer

        load_tokenizer(opened.folder / opened.gguf).save_pretrained(tmp)
        return sorted(p.name for p in tmp.iterdir())
    for p in side_files(opened.folder):  # tokenizer and generation settings, verbatim
        shutil.copy2(p, tmp / p.name)
        copied.append(p.name)
    return copied


def drift_summary(cal: dict[str, Any]) -> str:
    """One line on how far the converted model's residual stream drifted from the original's."""
    d = cal.get("residual_drift") or []
    if not d:
        return f"calibrated on {cal['tokens']:,} tokens"
    worst = max(range(len(d)), key=d.__getitem__)
    return (f"calibrated on {cal['tokens']:,} tokens; residual drift after the last layer {d[-1]:.3f} "
            f"(mean {sum(d) / len(d):.3f}, worst {d[worst]:.3f} after layer {worst + 1}; "  # counted from 1
            "0 = identical to the original)")


def changed(plan: Plan, settings: ResolvedSettings) -> dict[str, list[str]]:
    """The projections whose values the conversion changed, per grouped attention (by its
    name, e.g. "decoder.self_attention"): the method's `changes` in the family's names. LoRA
    uptraining puts its default adapters there."""
    spec = archmod.registry()[plan.family]
    return {SITE_NAMES[site]: changed_projections(spec.attention_at(site), settings.spec.changes)
            for site in plan.sites}


def write_metadata(tmp: Path, opened: Opened, plan: Plan, settings: ResolvedSettings, seconds: float,
                    calibration: dict[str, Any] | None = None, described: str | None = None,
                    query_orders: dict[int, list[int] | None] | None = None) -> None:
    """Everything but the weights into the folder `tmp`. `calibration`: the calibration stage's
    record; `described`: what the method did, in one line (default: its function's docstring);
    `query_orders`: each layer's query head order (`output_config`)."""
    cfg = output_config(plan, settings, query_orders)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copied = copy_side_files(opened, tmp)
    layout_family = per_layer_family(plan, settings)
    if not plan.native_gqa or layout_family is not None:
        from gqakit.convert.remote import modeling_file

        f = modeling_file(layout_family or plan.family)
        assert f.name.startswith(REMOTE_PREFIX)
        shutil.copy2(f, tmp / f.name)
    s, G = plan.shape, settings.num_kv_heads
    dtype = config_dtype(cfg) or str(_attention_dtype(plan)).removeprefix("torch.")  # as saved
    elem = DTYPE_BYTES.get(dtype) or _attention_dtype(plan).itemsize
    per_layer = [settings.kv_heads_at(L) for L in range(s.num_layers)]
    before, after = s.kv_bytes_per_token(elem), s.kv_bytes_per_token(elem, per_layer)
    auto = "AutoModelForSeq2SeqLM" if plan.is_encoder_decoder else "AutoModelForCausalLM"
    record = {"gqakit_version": gqakit.__version__, "settings": settings.record(), "family": plan.family,
              "num_heads": s.num_heads, "num_kv_heads_before": s.num_kv_heads,
              "num_kv_heads": None if settings.per_layer else G,
              **({"kv_heads": per_layer, "kv_heads_before": [s.kv_heads_of(L) for L in range(s.num_layers)]}
                 if layout_family is not None else {}),
              "head_dim": s.head_dim, "num_layers": s.num_layers,
              "parameters_before": plan.source_params, "parameters_after": plan.output_params,
              "kv_cache_bytes_per_token_before": before, "kv_cache_bytes_per_token_after": after,
              "kv_cache_dtype": dtype,
              "changed": changed(plan, settings), "seconds": round(seconds, 3), "copied_files": copied,
              "loads_with": f"{auto}.from_pretrained(OUT)" if plan.native_gqa and layout_family is None
              else f"{auto}.from_pretrained(OUT, trust_remote_code=True)"}
    enc = plan.encoder_shape
    if enc is not None:  # the decoder's numbers above hold for its self- and cross-attention alike
        record.update({"grouped": plan.grouped, "encoder_num_layers": enc.num_layers,
                       "encoder_num_heads": enc.num_heads, "encoder_num_kv_heads_before": enc.num_kv_heads,
                       "encoder_num_kv_heads": G if "encoder" in plan.sites else enc.num_kv_heads})
    if calibration:
        record["calibration"] = calibration
    if settings.kv_choice:  # --kv-budget: the per-layer table, each candidate's damage, why each layer got its G
        record["kv_budget"] = settings.kv_choice
    (tmp / CONVERT_SETTINGS).write_text(json.dumps(record, indent=2) + "\n")
    facts = {"source": f"`{settings.source_name}`", "family": plan.family, "method": settings.method,
             "grouping": settings.grouping, "query heads": s.num_heads,
             "KV heads": f"{s.num_kv_heads} → {G}" if layout_family is None else
             f"per layer {record.get('kv_heads_before')} → {per_layer}", "KV cache per token": f"{before:,} → "
             f"{kv_bytes_text(after, dtype)}, the saved dtype "
             f"({s.num_kv_heads // G if layout_family is None else f'{before / after:.2f}'}× smaller)",
             "parameters": f"{plan.source_params:,} → {plan.output_params:,}",
             "load with": f"`{record['loads_with']}`", "gqakit": gqakit.__version__}
    if enc is not None:
        facts["grouped attentions"] = ", ".join(plan.grouped)
        facts["KV heads"] = f"{s.num_kv_heads} → {G} (decoder self- and cross-attention)"
        facts["encoder KV heads"] = (f"{enc.num_kv_heads} → {G}" if "encoder" in plan.sites else
                                     f"{enc.num_kv_heads} (multi-head, as in the GQA paper; --group-encoder groups it)")
        facts["KV cache per token"] = (f"{before:,} → {kv_bytes_text(after, dtype)}, the saved dtype "
                                       f"({s.num_kv_heads // G}× smaller): the "
                                       "self-attention cache per output token, and the cross-attention cache "
                                       "per input token")
    if settings.auto_reasons():
        facts["chosen for this model"] = "; ".join(f"{k} {v}" for k, v in settings.auto_reasons().items())
    if settings.kv_choice:
        facts["KV budget"] = kv_budget_fact(settings.kv_choice)
    if calibration:
        facts["calibration"] = f"{calibration['calibration']} on {calibration['device']}"
        facts["residual drift"] = drift_summary(calibration).split("; ", 1)[-1]
        facts["expected quality"] = QUALITY_SIGNAL
    if described is None:
        fn = load(settings.spec.fn) if settings.spec.fn is not None else None
        doc = (getattr(fn, "__doc__", None) or "").strip().split("\n\n")[0]
        described = " ".join(doc.split())
    if described:
        facts["method"] = f"{settings.method}: {described}"
    remote_code = not plan.native_gqa or layout_family is not None
    written = archmod.registry()[layout_family or plan.family].remote  # the modeling file's classes
    vllm_class = written is not None and written.vllm_class  # vLLM's own class reads the folder
    summary = ("Grouped-query-attention conversion made with gqakit. Each group of K/V heads was pooled into "
               "one head; quality usually drops until the model is uptrained (`gqakit uptrain`).")
    # the card names the source by its Hub id (or folder name), never by a local path
    base = settings.source_name if settings.source_hub else hub_id_of(settings.source, plan.config)
    (tmp / "README.md").write_text(render_model_card(
        title=f"{settings.source_name.rsplit('/', 1)[-1]} → GQA ("
              f"{G if layout_family is None else f'{min(per_layer)}-{max(per_layer)}'} KV heads)", base_model=base,
        summary=summary, facts=facts, settings={**settings.record(), "source": settings.source_name,
                                                **({"kv_plan": settings.asked.kv_plan.name} if settings.asked.kv_plan
                                                   else {})},
        use_it=use_it_body(remote_code=remote_code, encoder_decoder=enc is not None,
                           gguf_arch=spec_gguf_arch(plan.family), vllm=not remote_code or vllm_class)))


def kv_budget_fact(choice: dict[str, Any]) -> str:
    """The card's line on a `--kv-budget` allocation: the budget, the plan, each layer's G and why."""
    rows = "; ".join(f"layer {r['layer']}: G={r['kv_heads']} ({r['why']})" for r in choice["layers"])
    probe = (choice.get("measured") or {}).get("probe")
    return (f"{choice['plan_bytes_per_token']:,} of {choice['budget_bytes_per_token']:,} bytes per token "
            f"(the source's: {choice['source_bytes_per_token']:,})"
            + (f", each layer's damage measured with {probe}" if probe else "") + f"; {rows}")


def spec_gguf_arch(family: str) -> str | None:
    """The GGUF architecture llama.cpp runs `family` as (the table's `gguf`), or None."""
    spec = archmod.registry()[family]
    return spec.gguf.arch if spec.gguf is not None else None


def _attention_dtype(plan: Plan) -> Any:
    """The dtype of the output K/V projections: the KV cache's natural dtype."""
    import torch

    for p in plan.tensors:
        if p.name in plan.layer_of:
            return p.dtype
    return torch.float32
