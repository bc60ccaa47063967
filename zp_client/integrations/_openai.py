"""What the integrations share: admitting one openai client (via ``wrap()``) with zp's per-model options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError
from zp_client.transport import DEADLINE_HEADER, PRIORITY_HEADER, ROUTE_HEADER
from zp_client import admitted_budget, wrap

C = TypeVar("C")


@dataclass(frozen=True)
class ZPOptions:
    """zp's options for every call of one model object (what ``wrap()`` takes, plus default headers)."""

    budget: Budget
    settings: Settings | None = None
    estimator: Any | None = None
    retry: Any | None = None
    forecaster: Any | None = None
    priority: int | None = None
    deadline: float | None = None
    route: str | None = None
    max_retries: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            raise ConfigurationError(
                f"budget must be a zp_client Budget (LocalBudget, RedisBudget), got {type(self.budget).__name__}"
            )
        if self.deadline is not None and not self.deadline > 0:
            raise ConfigurationError(f"deadline must be a positive number of seconds, got {self.deadline!r}")
        if self.max_retries < 0:
            raise ConfigurationError(f"max_retries must be >= 0, got {self.max_retries}")

    def headers(self) -> dict[str, str]:
        """The per-call zp headers as the model's default headers (a call's ``extra_headers`` win)."""
        out: dict[str, str] = {}
        if self.priority is not None:
            out[PRIORITY_HEADER] = str(int(self.priority))
        if self.deadline is not None:
            out[DEADLINE_HEADER] = repr(float(self.deadline))
        if self.route is not None:
            out[ROUTE_HEADER] = self.route
        return out


def admission_budget(client: Any) -> Budget | None:
    """The budget ``client`` (an openai client) is already admitted on, or None."""
    return admitted_budget(client)


def admit(client: C, opts: ZPOptions) -> C:
    """``client`` (``openai.OpenAI`` / ``AsyncOpenAI``) admission-gated on ``opts.budget``.

    A client already admitted on the same budget is returned as it is (a framework that rebuilds a
    model from its fields must not stack two admissions, i.e. two leases per call); on another budget
    it is an error.
    """
    current = admission_budget(client)
    if current is not None:
        if current is opts.budget:
            return client
        raise ConfigurationError(
            "this client is already admitted on another budget; build it again from an unwrapped client"
        )
    # The admitted client sends through the original's transport, and the original closes that
    # transport when it is garbage collected (openai's __del__). The frameworks drop the original as
    # soon as we replace it, so the admitted client keeps it alive (keep_original).
    new = wrap(client, opts.budget, settings=opts.settings, estimator=opts.estimator, retry=opts.retry,
               forecaster=opts.forecaster, keep_original=True)
    extra: dict[str, Any] = {}
    headers = opts.headers()
    if headers:
        extra["default_headers"] = headers
    if opts.max_retries:
        # asked for explicitly: the SDK's retries then run around zp's (each SDK attempt is a new
        # admission, each with zp's own retries inside), so attempts multiply
        extra["max_retries"] = opts.max_retries
    if extra:
        new = new.with_options(**extra)  # type: ignore[attr-defined]
    return new
