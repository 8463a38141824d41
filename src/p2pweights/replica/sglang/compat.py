"""Every sglang symbol and text p2pweights relies on, checked once per process.

p2pweights runs sglang's own model code and reaches into a few of its internals
(private loader helpers, the runtime context, the rotary module's platform flag),
hooks some of its functions (the plugin's hook targets) and recognises some of its
answers by their words (``wire.sglang_texts``). Those move between sglang releases.
``check_sglang`` imports each symbol up front and finds each text in the source of
the sglang function that emits it; if any is missing it raises one ``ConfigError``
naming them all, the installed sglang and the tested range, instead of an
``AttributeError`` deep inside a replica build or a reworded answer silently taken
for another.

Add a symbol here when a module of p2pweights starts using it, a text to
``wire.sglang_texts`` when one starts matching on it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from p2pweights.errors import ConfigError
from p2pweights.replica.sglang.hook_targets import HOOK_TARGETS
from p2pweights.wire.sglang_texts import TEXTS, SglangText

try:
    import sglang
except ImportError as exc:  # the optional extra is not installed
    raise ConfigError(
        "sglang is not installed; p2pweights builds engine replicas with sglang's model "
        "code: pip install 'p2pweights[sglang]'"
    ) from exc

logger = logging.getLogger(__name__)

__all__ = [
    "SGLANG_VERSION",
    "TESTED_SGLANG",
    "is_tested",
    "SglangBuild",
    "sglang_build",
    "Symbol",
    "REQUIRED",
    "PLUGIN_REQUIRED",
    "check_sglang",
    "missing_symbols",
    "missing_texts",
    "hook_target",
    "SglangApiError",
    "API_ERRORS",
    "api_error",
]

SGLANG_VERSION: str = sglang.__version__
"""The installed sglang."""

TESTED_SGLANG = ("0.5.23", "0.5.23")
"""Oldest and newest sglang release p2pweights is tested with (pyproject allows 0.5.21 -
0.5.23, the releases with begin/end_weight_update; this check names what an older one lacks)."""


@dataclass(frozen=True)
class Symbol:
    """``module`` exports ``name`` (a dotted path for a class member)."""

    module: str
    name: str
    used_by: str
    """Where p2pweights uses it, for the error message."""

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


def _symbols(module: str, used_by: str, *names: str) -> tuple[Symbol, ...]:
    return tuple(Symbol(module, name, used_by) for name in names)


def hook_target(target: str, used_by: str) -> Symbol:
    """The symbol of a dotted hook target: the module is the part before the first
    capitalised name (``pkg.module.Class.method`` -> ``pkg.module``, ``Class.method``)."""
    parts = target.split(".")
    first = next((i for i, part in enumerate(parts) if part[:1].isupper()), len(parts) - 1)
    return Symbol(".".join(parts[:first]), ".".join(parts[first:]), used_by)


_LOADER = "sglang.srt.model_loader.loader"
_CONTEXT = "sglang.srt.runtime_context"

REQUIRED: tuple[Symbol, ...] = (
    *_symbols("sglang.srt.server_args", "replica.sglang.env", "ServerArgs"),
    # engine processes publish process-wide; replicas build their own contexts
    *_symbols(
        "sglang.srt.server_args", "replica.sglang.env", "set_global_server_args_for_scheduler"
    ),
    *_symbols(
        _CONTEXT,
        "replica.sglang.env",
        "create_context",
        "use_context",
        "get_parallel",
        "get_server_args",
        "get_spec",
        "ParallelContext.override",
    ),
    *_symbols(
        _LOADER,
        "replica.sglang (build, reload layout, reference)",
        "_initialize_model",
        "_get_quantization_config",
        "_modules_with_quant_method",
        "post_load_weights",
        "device_loading_context",
        "DefaultModelLoader.load_weights_and_postprocess",
        "DefaultModelLoader.restore_weights_before_loading",
        "DefaultModelLoader.postprocess_weights",
        "QuantizedRLModelLoader.is_reload_scenario",
    ),
    *_symbols("sglang.srt.model_loader.utils", "replica.sglang", "set_default_torch_dtype"),
    # patched for the loading thread by replica.sglang.replay.inline_loads
    *_symbols("sglang.srt.model_loader.utils", "replica.sglang.replay", "should_async_load"),
    *_symbols(
        "sglang.srt.configs.model_config", "replica.sglang.env", "ModelConfig.from_server_args"
    ),
    *_symbols("sglang.srt.configs.load_config", "replica.sglang.env", "LoadConfig"),
    *_symbols("sglang.srt.layers.moe", "replica.sglang.env", "initialize_moe_config"),
    *_symbols(
        "sglang.srt.layers.moe.utils",
        "replica.sglang.env (draft runner)",
        "draft_model_build_scope",
        "speculative_moe_backend_context",
        "speculative_moe_a2a_backend_context",
    ),
    *_symbols(
        "sglang.srt.layers.quantization.base_config",
        "replica.sglang.reload_layout",
        "QuantizeMethodBase.process_weights_after_loading",
        "QuantizeMethodBase.restore_weights_before_loading",
    ),
    # the CPU-only trap (see replica.sglang.env): flags patched while a rope is built
    *_symbols("sglang.srt.utils", "replica.sglang.env", "is_cuda"),
    *_symbols("sglang.srt.layers.rotary_embedding.base", "replica.sglang.env", "_is_cpu"),
    *_symbols(
        "sglang.srt.layers.rotary_embedding.rope_variant", "replica.sglang.env", "get_device"
    ),
    *_symbols(
        "sglang.srt.utils.weight_checker", "replica.sglang.facade", "WeightChecker", "_hash_tensor"
    ),
    *_symbols("sglang.srt.utils.msgspec_utils", "replica.sglang.facade", "msgspec_to_builtins"),
    *_symbols("sglang.srt.server_args", "replica.sglang.facade", "ServerArgs.resolved_dict"),
)
"""What a trainer process uses: replicas, reference models, the local engine, verification."""

PLUGIN_REQUIRED: tuple[Symbol, ...] = (
    *_symbols(
        "sglang.srt.plugins.hook_registry",
        "sglang_plugin",
        "HookRegistry.register",
        "HookType.REPLACE",
        "HookType.BEFORE",
        "HookType.AFTER",
    ),
    *_symbols(_CONTEXT, "sglang_plugin", "get_model", "get_parallel", "get_serving"),
    *_symbols("sglang.srt.utils.network", "sglang_plugin", "NetworkAddress"),
    # every function and class the plugin hooks, from the plugin's own list
    *(hook_target(target, "sglang_plugin (hook target)") for target in HOOK_TARGETS),
)
"""What the NIXL plugin uses inside an sglang engine process (heavy imports: not checked
by default; ``check_sglang(PLUGIN_REQUIRED)`` there)."""


def missing_symbols(symbols: Sequence[Symbol]) -> list[tuple[Symbol, str]]:
    """Each symbol the installed sglang lacks, with why (the import or attribute error)."""
    missing = []
    for symbol in symbols:
        try:
            found: object = importlib.import_module(symbol.module)
            for part in symbol.name.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            missing.append((symbol, f"{type(exc).__name__}: {exc}"))
    return missing


CHECKS_KEPT = 8
"""Symbol sets whose check is remembered (``REQUIRED``, ``PLUGIN_REQUIRED``, a caller's own)."""


def missing_texts(texts: Sequence[SglangText]) -> list[tuple[SglangText, str]]:
    """Each text the installed sglang's emitting function no longer holds, with why."""
    missing = []
    for text in texts:
        try:
            found: object = importlib.import_module(text.module)
            for part in text.function.split("."):
                found = getattr(found, part)
            source = inspect.getsource(inspect.unwrap(found))  # type: ignore[arg-type]
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            missing.append((text, f"{type(exc).__name__}: {exc}"))
            continue
        if text.text not in source:
            missing.append((text, "the function no longer says it (reworded?)"))
    return missing


@functools.lru_cache(maxsize=CHECKS_KEPT)
def check_sglang(
    symbols: tuple[Symbol, ...] = REQUIRED, texts: tuple[SglangText, ...] = TEXTS
) -> None:
    """Raise ``ConfigError`` unless the installed sglang has every symbol and still emits
    every text p2pweights matches on; once per process (per argument set).

    A release outside ``TESTED_SGLANG`` that has them all is logged, not refused.
    """
    missing = [
        f"{symbol} (used by {symbol.used_by}; {why})" for symbol, why in missing_symbols(symbols)
    ] + [
        f"the text {text} (matched by {text.used_by}; {why})" for text, why in missing_texts(texts)
    ]
    low, high = TESTED_SGLANG
    build = sglang_build(SGLANG_VERSION)
    if missing:
        raise ConfigError(
            f"the installed sglang {build} lacks what p2pweights relies on: "
            + "; ".join(missing)
            + f". p2pweights is tested with sglang {low} to {high}: install one of those "
            f"(pip install 'sglang>={low},<={high}')"
            + (
                ", or a branch build that carries every name above (the engines must run "
                "the same build)"
                if build.is_source_build
                else ""
            )
        )
    if not is_tested():
        logger.warning(
            "sglang %s is outside the tested range %s to %s; its symbols check out, but a "
            "replica's bytes are only verified for the tested releases",
            build,
            low,
            high,
        )


class SglangApiError(ConfigError):
    """sglang's own code did not behave as p2pweights expects (an API that moved or
    changed): not a problem of the user's tensors; the installed sglang is the cause."""


API_ERRORS: tuple[type[Exception], ...] = (AttributeError, TypeError, ImportError, NameError)
"""What sglang's code raises when an API it or p2pweights calls moved or changed; a
tensor that does not fit raises other errors there (shape assertions, ``narrow`` and
``copy_`` refusing: AssertionError, RuntimeError, IndexError, ValueError)."""


def api_error(exc: BaseException, doing: str) -> SglangApiError | None:
    """``SglangApiError`` for ``exc`` raised while ``doing``, if it is one of ``API_ERRORS``.

    The caller raises it ``from exc``; None means the exception is not sglang's API.
    """
    if not isinstance(exc, API_ERRORS):
        return None
    low, high = TESTED_SGLANG
    tested = "within" if is_tested() else "outside"
    return SglangApiError(
        f"sglang's code did not behave as p2pweights expects while {doing}: "
        f"{type(exc).__name__}: {exc}. This is not a problem of the tensor: the installed "
        f"sglang {sglang_build(SGLANG_VERSION)} ({tested} the tested range) changed an API "
        f"p2pweights relies on. p2pweights is tested with sglang {low} to {high}: install "
        f"one of those (pip install 'sglang>={low},<={high}') or report the traceback"
    )


def is_tested(version: str | None = None) -> bool:
    """Whether ``version`` (the installed sglang by default) is within ``TESTED_SGLANG``.

    A development build of a release precedes it (PEP 440): ``0.5.24.dev3+g1a2b3c4``,
    a branch three commits past the 0.5.23 tag, is not 0.5.24, and ``0.5.23.dev3`` is
    not 0.5.23. A post release counts as its release.
    """
    low, high = TESTED_SGLANG
    found = sglang_build(SGLANG_VERSION if version is None else version)
    return sglang_build(low).order <= found.order <= sglang_build(high).order


_VERSION = re.compile(
    r"^v?(?P<release>\d+(?:\.\d+)*)"
    r"(?P<pre>(?:a|b|rc)\d+)?"
    r"(?:\.post(?P<post>\d+))?"
    r"(?:\.dev(?P<dev>\d+))?"
    r"(?:\+(?P<local>[0-9A-Za-z.]+))?$"
)


@dataclass(frozen=True)
class SglangBuild:
    """An sglang version string, read the way sglang's own build writes it.

    sglang numbers itself with setuptools_scm from the nearest ``v*`` tag (``git describe
    --tags --long --match v*``, python/pyproject.toml). A checkout N commits past a tag
    ``vX.Y.Z`` is ``X.Y.(Z+1).devN+g<commit>`` (``.d<date>`` added when the tree is
    dirty): the form a branch build such as miles' ``sglang-miles``, rebased onto a
    release tag and installed with ``pip install -e python``, reports.
    """

    version: str
    release: tuple[int, ...]
    """The leading numeric parts (``0.5.24.dev3`` -> ``(0, 5, 24)``)."""
    is_prerelease: bool
    """A ``.devN`` (without ``.postN``) or ``aN`` / ``bN`` / ``rcN`` version: before ``release``."""
    commits_past_tag: int | None
    """N of ``.devN``: commits since the tag the build was numbered from."""
    commit: str | None
    """The abbreviated git commit of a source build (``+g<commit>``)."""

    @property
    def is_source_build(self) -> bool:
        """Built from a git checkout past a release tag, not a published release."""
        return self.commits_past_tag is not None or self.commit is not None

    @property
    def order(self) -> tuple[tuple[int, ...], int]:
        """Sort key: a pre-release or development build of a release sorts before it."""
        padded = self.release + (0,) * (4 - len(self.release))
        return padded, -1 if self.is_prerelease else 0

    def __str__(self) -> str:
        if not self.is_source_build:
            return self.version
        past = (
            f"{self.commits_past_tag} commits past the release tag before "
            f"{'.'.join(map(str, self.release))}"
            if self.commits_past_tag is not None and self.is_prerelease
            else "past a release tag"
        )
        at = f" at commit {self.commit}" if self.commit else ""
        return (
            f"{self.version} (a build from a git checkout{at}, {past}: a branch such as "
            f"miles' sglang-miles, not a published sglang release)"
        )


def sglang_build(version: str) -> SglangBuild:
    """``version`` read as an sglang version string (see ``SglangBuild``)."""
    match = _VERSION.match(version.strip())
    if match is None:
        return SglangBuild(version, _release(version), False, None, None)
    local = match["local"] or ""
    commit = next(
        (part[1:] for part in local.split(".") if re.fullmatch(r"g[0-9a-f]{7,40}", part)), None
    )
    dev = None if match["dev"] is None else int(match["dev"])
    return SglangBuild(
        version=version,
        release=tuple(int(part) for part in match["release"].split(".")),
        is_prerelease=match["pre"] is not None or (dev is not None and match["post"] is None),
        commits_past_tag=dev,
        commit=commit,
    )


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric parts: ``"0.5.23.post1"`` -> ``(0, 5, 23)``."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)
