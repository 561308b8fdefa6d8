"""Stacks of `specdec serve` services (a target, and the drafts and coordinators on it) and the flags
each service gets: the one place `specdec up`, `specdec bench` (both comparisons) and `specdec
loadtest` build them, so the tools cannot drift apart on how a draft is configured.

    stack = Stack(target, logs)                  # logs: a folder (a tool's stack) or None (`specdec up`)
    stack.start_target()
    draft = stack.start_draft("ngram")            # or a draft model: alias, folder, hub id
    coordinator = stack.start_coordinator(draft)
    stack.wait()

`draft_flags` is the draft's command line; `draft_config` the same draft for an engine built in
this process (bench's one-process configurations).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from specdec_tools.children import ServiceProcesses


def needs_target_tokenizer(drafter: str, target: str) -> bool:
    """Whether a draft model may speak another vocabulary than its target: any model other than the
    target (the draft service falls back to plain drafting when the two tokenizers turn out
    identical), except a pruned distilled draft or a feature draft, built on the target's own."""
    from specdec.model.loading import feature_draft_folder, pruned_draft_folder

    return (drafter not in ("", "ngram", target) and pruned_draft_folder(drafter) is None
            and feature_draft_folder(drafter) is None)


def draft_flags(drafter: str, target: str, device: str = "cpu") -> list[str]:
    """`specdec serve draft` flags: `drafter` is 'ngram' or a draft model (alias, folder, hub id;
    empty: the service's own choice) drafting for `target` (its model spec, whose tokenizer a draft
    of another vocabulary maps its tokens to)."""
    if drafter == "ngram":
        return ["--drafter", "ngram", "--device", device]
    return ["--drafter", "model", *(["--model", drafter] if drafter else []), "--device", device,
            *(["--target-tokenizer", target] if needs_target_tokenizer(drafter, target) else [])]


def draft_config(drafter: str, target: str, device: str = "cpu"):
    """The DraftConfig `specdec serve draft` builds from `draft_flags` (environment ignored): the
    same draft, for an engine in this process."""
    from draft_service.config import ENV_PREFIX, DraftConfig
    from specdec.serving.config import from_argv

    return from_argv(DraftConfig, draft_flags(drafter, target, device), ENV_PREFIX, "specdec serve draft", env={})


class Stack(ServiceProcesses):
    """One target service and the drafts and coordinators on it, as `specdec serve` child processes.

    `target`: the target model spec, also the coordinators' tokenizer and the drafts' target
    tokenizer; empty: the services' default (`specdec up` without --target-model). `logs`: see
    specdec_tools/children.py. `log_level`: every service's. `port` (each start_*): 0 picks a free one.
    `backend_token`: the --backend-token all of them share (empty: off).
    """

    def __init__(self, target: str, logs: pathlib.Path | None, device: str = "cpu", log_level: str | None = None,
                 grace: float = 20.0, backend_token: str = ""):
        super().__init__(logs, grace, backend_token)
        self.target, self.device, self.log_level = target, device, log_level
        self.target_address = ""

    def start_target(self, *extra: str, core: int | None = None, port: int = 0, replicas: int = 1) -> str:
        """`replicas` target services (the first on `port`, the rest on free ports; each its own
        process with its own metrics port); the coordinators' --target: their addresses, comma-separated."""
        model = ["--model", self.target] if self.target else []
        self.target_address = self._replicas("target", [*model, "--device", self.device, *extra], core, port, replicas)
        return self.target_address

    def _replicas(self, role: str, flags: list[str], core: int | None, port: int, replicas: int) -> str:
        metrics = ["--metrics-port", "0"] if replicas > 1 and self.logs is None else []  # else they would share one port
        return ",".join(self.spawn(role, *flags, *metrics, core=core, log_level=self.log_level, port=port if i == 0 else 0)
                        for i in range(replicas))

    def drafts_for_target(self, drafter: str, draft_address: str, replicas: int = 1) -> list[str]:
        """The target's --draft for `drafter` served at `draft_address`: a model draft (a feature
        draft too), one replica of it (the target keeps one Drafts stream); its coordinators then
        start model-draft requests as drafted runs (target_service/runs.py). The n-gram drafter
        needs none: the target drafts by prompt lookup itself."""
        if drafter == "ngram" or replicas != 1 or "," in draft_address:
            return []
        return ["--draft", draft_address]

    def start_draft(self, drafter: str, core: int | None = None, port: int = 0, replicas: int = 1) -> str:
        """`replicas` draft services for `drafter` ('ngram' or a draft model), as start_target."""
        from specdec.model.loading import DEFAULT_TARGET

        flags = draft_flags(drafter, self.target or DEFAULT_TARGET, self.device)
        return self._replicas("draft", flags, core, port, replicas)

    def start_coordinator(self, draft: str, *extra: str, core: int | None = None, port: int = 0) -> str:
        """A coordinator on this stack's target; `draft`: a draft service's address, 'ngram' (prompt
        lookup in the coordinator) or '' (no speculation)."""
        tokenizer = ["--tokenizer", self.target] if self.target else []
        return self.spawn("coordinator", "--target", self.target_address, "--draft", draft, *tokenizer, *extra,
                          core=core, log_level=self.log_level, port=port)

    def wait(self, timeout: float = 600.0, announce: Callable[[str, str], None] | None = None) -> None:
        """Until every service started reports SERVING (see ServiceProcesses.wait_healthy)."""
        self.wait_healthy(list(self.roles), timeout, announce)
