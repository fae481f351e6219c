"""The doctor's text: one line that answers, then why.

The first line names the backend vLLM 0.33 selects for the model and cache dtype on this GPU,
whether that is this plugin, and the flag to pass when one is needed; where the selected backend
is known to fail on the GPU (:data:`.models.KNOWN_ISSUES`) the flag and the consequence come
first. Everything after it explains: vLLM's rewrites of the cache dtype, each sparse backend vLLM
considered, what the plugin serves here, the rest of the DSA path and the kernel path.
"""

from __future__ import annotations

from .models import KNOWN_ISSUES, Model, capability_text
from .simulation import Case, Choice, IndexerPart, PluginStatus

OURS_TEXT = "TRITON_MLA_SPARSE (this plugin"
# Bytes of one token's MLA cache row per layer, by the cache dtype the layer ends up with, and of
# its indexer K row (128 e4m3 values + one float32 scale). Every GPU holds the whole row: the MLA
# latent is one head, which tensor parallelism does not split.
ROW_BYTES = {
    "auto": 1152,
    "bfloat16": 1152,
    "float16": 1152,
    "fp8": 576,
    "fp8_e4m3": 576,
    "fp8_ds_mla": 656,
}
INDEXER_ROW_BYTES = 132


def cache_text(dtype: str) -> str:
    return {
        "auto": "bf16 cache, the model dtype",
        "bfloat16": "bf16 cache",
        "float16": "fp16 cache",
        "fp8": "fp8 e4m3 cache, per-tensor scale",
        "fp8_e4m3": "fp8 e4m3 cache, per-tensor scale",
        "fp8_ds_mla": "fp8_ds_mla cache, 656-byte rows",
    }.get(dtype, f"{dtype} cache")


# The cache in a few words, for the first line (the details say more).
_SHORT_CACHE = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8 e4m3"}


def _cache(dtype: str) -> str:
    return f"{_SHORT_CACHE.get(dtype, dtype)} cache"


SINK_DROPPED = "learnable sink dropped: not the trained model"


def _selected(choice: Choice) -> str:
    if choice.ours:
        return f"vLLM 0.33 selects {OURS_TEXT}, {_cache(choice.cache_dtype)})"
    out = f"vLLM 0.33 selects {choice.backend} (vLLM's, {_cache(choice.cache_dtype)}"
    if choice.sink_dropped:
        out += f", {SINK_DROPPED}"
    if choice.uncertain:
        out += f"; {' or '.join(choice.uncertain)} may come first on a real GPU"
    return out + ")"


def first_line(case: Case, cap: tuple[int, int], plugin: PluginStatus, indexer: IndexerPart) -> str:
    """The answer: what vLLM selects, whether it is this plugin, the flag to pass."""
    a, e = case.auto, case.explicit
    head = (
        f"{case.model.label} TP{case.tp}, --kv-cache-dtype {case.kv_flag}, {capability_text(cap)}: "
    )
    flag = f"--attention-backend {plugin.flag}"
    blocked = f"; serving still fails here: {indexer.blockers[0]}" if indexer.blockers else ""
    if a.backend is None and a is e:  # refused before selection (vLLM's config check)
        return f"{head}vLLM 0.33 refuses the configuration: {a.error}"
    issue = None if a.backend is None or a.ours else KNOWN_ISSUES.get((cap, a.backend))
    if issue and e.ours:  # the consequence and the flag first
        return (
            f"{head}pass {flag} (this plugin, {_cache(e.cache_dtype)}): without it "
            f"{_selected(a)}, and {issue}{blocked}"
        )
    if a.backend is None:
        out = f"{head}vLLM 0.33 finds no valid sparse MLA backend (serving fails)"
    else:
        out = head + _selected(a)
        if issue:
            out += f", and {issue}"
    if a.ours:
        out += "; no flag needed"
    elif e.ours:
        how = "pass" if a.backend is None else "this plugin only with"
        out += f"; {how} {flag} ({_cache(e.cache_dtype)})"
    elif not plugin.active:
        out += f"; this plugin is not loaded by vLLM ({plugin.lines[-1]})"
    else:
        out += f"; this plugin cannot serve it either: {e.error}"
    return out + blocked


def selected_backend(line: str) -> str | None:
    """The backend a first line says vLLM selects (None: none valid); for tests and scripts."""
    marker = "vLLM 0.33 selects "
    if marker not in line:
        return None
    name = line.split(marker, 1)[1].split(" ", 1)[0]
    return "CUSTOM" if name == "TRITON_MLA_SPARSE" else name


def _choice_line(label: str, case: Case, choice: Choice) -> str:
    if choice.backend is None:
        return f"{label}: vLLM fails: {choice.error}"
    name = "TRITON_MLA_SPARSE (this plugin)" if choice.ours else choice.backend
    if choice.sink_dropped:
        name += f" ({SINK_DROPPED})"
    note = ""
    if choice.cache_dtype != case.kv_after_hook:
        note = f" ({choice.backend} serves {case.kv_after_hook} as {choice.cache_dtype})"
    return f"{label}: {name}, kv cache {choice.cache_dtype}{note}"


def memory_line(model: Model, cache_dtype: str) -> str:
    """The KV cache per token on each GPU, as arithmetic."""
    row = ROW_BYTES[cache_dtype]
    per_token = model.layers * (row + INDEXER_ROW_BYTES)
    return (
        f"KV cache per token on each GPU, {cache_text(cache_dtype)} (the latent is not split by "
        f"TP): {model.layers} layers x ({row} + {INDEXER_ROW_BYTES} indexer) B = {per_token} B "
        f"= {per_token / 1000:.1f} KB"
    )


def details(
    case: Case,
    cap: tuple[int, int],
    plugin: PluginStatus,
    indexer: IndexerPart,
    caches: tuple[list[str], dict[str, str]],
    kernel: list[str],
) -> list[str]:
    """Why the first line says what it says, in vLLM's order."""
    tag = capability_text(cap)
    out = [
        f"{case.model.label} at TP{case.tp}: {case.heads} query heads per GPU; checkpoint taken "
        "as bf16 without a kv-cache quantization scheme"
    ]
    if case.hook_note:
        out.append(case.hook_note)
    out.append(_choice_line("automatic selection", case, case.auto))
    if case.auto.candidates:
        out.append(f"  sparse MLA backends in vLLM's priority order at {tag}:")
        chosen = "CUSTOM" if case.auto.ours else case.auto.backend
        for name, reasons in case.auto.candidates:
            shown = "TRITON_MLA_SPARSE (this plugin)" if name == "CUSTOM" else name
            if reasons:
                out.append(f"    {shown}: rejected: {'; '.join(dict.fromkeys(reasons))}")
            elif name == chosen:
                out.append(f"    {shown}: valid, selected")
            else:
                out.append(f"    {shown}: valid, lower priority")
    out.append(_choice_line(f"with --attention-backend {plugin.flag}", case, case.explicit))
    works, refused = caches
    if works:
        out.append(
            f"cache dtypes this plugin serves {case.model.label} with here: {', '.join(works)}"
        )
    for kv, why in refused.items():
        out.append(f"  --kv-cache-dtype {kv}: {why}")
    for choice in (case.auto, case.explicit):
        if choice.backend is not None:
            mem = memory_line(case.model, choice.cache_dtype)
            if mem not in out:
                out.append(mem)
    out.append("")
    out.append(f"DSA path beyond attention at {tag}:")
    out += ["  " + line for line in indexer.lines]
    if indexer.blockers:
        out.append("  still blocks serving here, whatever attention does:")
        out += [f"    - {b}" for b in indexer.blockers]
    else:
        out.append("  nothing else known blocks serving here")
    out.append("")
    out += kernel
    return out
