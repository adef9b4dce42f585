"""The capability matrix: rendered from what each strategy declares (``capabilities``).

``fedlora capabilities --write`` regenerates the table between the README's markers, the
Flower-DP table of docs/flower.md, the table of docs/secure-aggregation.md and the server
optimiser / FedProx table of docs/strategies.md;
``tests/test_capabilities.py`` fails when a copy is stale.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


def deployment_tested() -> list[str]:
    """The strategies the test suite runs over a real gRPC federation (TLS + SuperNode auth): every
    built-in method. tests/test_deploy_strategies.py::test_every_strategy_runs_over_tls_grpc runs every
    registered strategy and fails unless each completes there, so the matrix's "deployment" column says
    what that test ran and checked, with no list to keep (a method of another package is not fedlora's
    to claim)."""
    from fedlora.methods import built_in_names

    return built_in_names()


START = "<!-- capabilities:start -->"
END = "<!-- capabilities:end -->"
COLUMNS = (
    ("model", "personalised or global model"),
    ("uploads", "what a client sends"),
    ("downloads", "what a client receives"),
    ("mixed ranks", "clients may declare different LoRA ranks"),
    ("partial participation", "works when only some clients train each round"),
    ("DP", "client steps compatible with Opacus DP-SGD"),
    ("Flower DP", ("Flower's DifferentialPrivacyClientSideFixedClipping can wrap the strategy, fedlora's ClientApp "
                   "clipping with fixedclipping_mod (a 'no' refuses it with one line saying why: docs/flower.md)")),
    ("SecAgg", ("secure_aggregation.enabled = true aggregates it with SecAgg+, the server never seeing one "
                "client's update ('one rank': refused with mixed ranks; a 'no' refuses it with one line saying why: "
                "docs/secure-aggregation.md)")),
    ("causal LM", ("runs on model.kind = 'causal_lm' (tests/test_causal_lm.py runs every strategy on "
                  "configs/llm_smoke.toml; a 'no' refuses it with one line)")),
    ("robust aggregation", ("faults.aggregation = 'median' / 'trimmed_mean' / 'bulyan' replaces its weighted "
                            "means, 'krum' / 'multikrum' / 'bulyan' select its uploads first (a 'no' refuses "
                            "them with one line saying why: docs/robustness.md)")),
    ("FedOpt / FedProx", ("'server opt': server_optimizer.name = 'fedavgm' / 'fedadam' / 'fedyogi' steps on its "
                          "mean; 'FedProx': train.proximal_mu adds FedProx's term to its clients' objective ('both', "
                          "or one of them; what it cannot take is refused with one line saying why: docs/strategies.md)")),
    ("deployment", "exercised over real gRPC SuperLink/SuperNodes by the test suite"),
    ("paper", "reference"),
)


def _tick(flag: bool) -> str:
    return "yes" if flag else "no"


def _secure(caps: Any) -> str:
    """'yes', 'one rank' (refused with mixed ranks) or 'no': the matrix's SecAgg cell."""
    if not caps.secure_aggregation:
        return "no"
    return "one rank" if caps.secure_one_rank else "yes"


def _fl_optimisers(caps: Any) -> str:
    """'both', 'server opt', 'FedProx' or 'no': the matrix's FedOpt / FedProx cell."""
    taken = [name for name, flag in (("server opt", caps.server_optimizer), ("FedProx", caps.proximal)) if flag]
    return "both" if len(taken) == 2 else (taken[0] if taken else "no")


def _paper(name: str, caps: Any) -> str:
    """The paper cell, with the method's other names (e.g. fedit's ``fedavg``)."""
    from fedlora.methods import method

    aliases = ", ".join(f"`{alias}`" for alias in method(name).aliases)
    return f"{caps.paper}; also named {aliases}" if aliases else caps.paper


def capability_rows() -> list[list[str]]:
    from fedlora.methods import method, method_names

    tested = deployment_tested()
    rows = []
    for name in method_names():
        caps = method(name).capabilities
        rows.append([
            f"`{name}`",
            "personalised" if caps.personalized else "global",
            caps.uploads,
            caps.downloads,
            _tick(caps.mixed_ranks),
            _tick(caps.partial_participation),
            _tick(caps.dp_compatible),
            _tick(caps.flower_dp),
            _secure(caps),
            _tick(not caps.causal_lm),
            _tick(caps.robust_aggregation),
            _fl_optimisers(caps),
            _tick(name in tested),
            _paper(name, caps),
        ])
    return rows


def render_matrix() -> str:
    """The matrix as a markdown table (with the legend of its columns)."""
    header = ["strategy", *(name for name, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in capability_rows()]
    legend = "; ".join(f"*{name}*: {meaning}" for name, meaning in COLUMNS[3:-1])
    return "\n".join(lines) + f"\n\n{legend}. Generated by `fedlora capabilities --write`."


FLOWER_DP_START = "<!-- flower-dp:start -->"
FLOWER_DP_END = "<!-- flower-dp:end -->"


def _why_table(column: str, cell: Callable[[Any], str], why: Callable[[Any], str]) -> str:
    """One row per strategy: ``cell(capabilities)`` under ``column`` and ``why(capabilities)``."""
    from fedlora.methods import method, method_names

    lines = [f"| strategy | {column} | why not |", "|---|---|---|"]
    for name in method_names():
        caps = method(name).capabilities
        reason = why(caps).replace("|", "\\|")  # a pipe would end the cell
        lines.append(f"| `{name}` | {cell(caps)} | {reason} |")
    return "\n".join(lines) + "\n\nGenerated by `fedlora capabilities --write`."


def render_flower_dp() -> str:
    """Per strategy, whether Flower's client-side fixed-clipping DP wrapper can wrap it, and why not."""
    return _why_table("Flower DP", lambda caps: _tick(caps.flower_dp), lambda caps: caps.not_flower_dp)


SECURE_START = "<!-- secure-aggregation:start -->"
SECURE_END = "<!-- secure-aggregation:end -->"


def render_secure() -> str:
    """Per strategy, whether it aggregates with secure aggregation (SecAgg+), and why not."""
    return _why_table("SecAgg", _secure,
                      lambda caps: caps.secure_one_rank if caps.secure_aggregation else caps.not_secure)


FL_OPTIMISERS_START = "<!-- fl-optimisers:start -->"
FL_OPTIMISERS_END = "<!-- fl-optimisers:end -->"


def render_fl_optimisers() -> str:
    """Per strategy, whether it takes a server optimiser and FedProx's term, and why not."""
    from fedlora.methods import method, method_names

    lines = ["| strategy | server optimiser | FedProx | why not |", "|---|---|---|---|"]
    for name in method_names():
        caps = method(name).capabilities
        why = "; ".join(reason for reason in (caps.not_server_optimizer, caps.not_proximal) if reason)
        lines.append(f"| `{name}` | {_tick(caps.server_optimizer)} | {_tick(caps.proximal)} | "
                     f"{why.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n\nGenerated by `fedlora capabilities --write`."


def _block(start: str, end: str) -> re.Pattern[str]:
    return re.compile(re.escape(start) + r"\n(.*?)" + re.escape(end), flags=re.DOTALL)


def readme_block(readme: str, start: str = START, end: str = END) -> str | None:
    match = _block(start, end).search(readme)
    return match.group(1).rstrip("\n") if match else None


def write_readme(path: str | Path = "README.md") -> bool:
    """Replace the README's matrix; returns True when it changed."""
    return _write_block(path, START, END, render_matrix(), "--readme")


def write_flower_doc(path: str | Path = "docs/flower.md") -> bool:
    """Replace docs/flower.md's Flower-DP table (:func:`render_flower_dp`); True when it changed."""
    return _write_block(path, FLOWER_DP_START, FLOWER_DP_END, render_flower_dp(), "--flower-doc")


def write_secure_doc(path: str | Path = "docs/secure-aggregation.md") -> bool:
    """Replace docs/secure-aggregation.md's table (:func:`render_secure`); True when it changed."""
    return _write_block(path, SECURE_START, SECURE_END, render_secure(), "--secure-doc")


def write_strategies_doc(path: str | Path = "docs/strategies.md") -> bool:
    """Replace docs/strategies.md's server optimiser / FedProx table (:func:`render_fl_optimisers`)."""
    return _write_block(path, FL_OPTIMISERS_START, FL_OPTIMISERS_END, render_fl_optimisers(), "--strategies-doc")


def _write_block(path: str | Path, start: str, end: str, fresh: str, option: str) -> bool:
    from fedlora.errors import ConfigError

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{option} {path}: no such file")
    text = path.read_text()
    current = readme_block(text, start, end)
    if current is None:
        raise ConfigError(f"{option} {path} has no {start} ... {end} block to regenerate")
    if current == fresh:
        return False
    path.write_text(_block(start, end).sub(lambda _: f"{start}\n{fresh}\n{end}", text, count=1))
    return True
