"""Several traces of one image in one Explorer (e.g. the gradient trace and a backward-rule trace): their names,
the labels of the page's trace picker, and the refusal of traces of different inputs, checked before any widget
is built.

Example:
    >>> import timm, numpy as np, vitcam_nb as vc
    >>> m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1).eval()
    >>> x = np.zeros((32, 32, 3), np.uint8)
    >>> tr, rel = vc.trace(m, x, targets="top1"), vc.trace(m, x, targets="top1", rule="cp_lrp")
    >>> list(named_traces([tr, rel]))
    ['gradient', 'cp_lrp']
    >>> trace_choices(named_traces({"plain": tr, "lrp": rel}))
    [['plain', 'plain · backward rule gradient'], ['lrp', 'lrp · backward rule cp_lrp']]
    >>> trace_choices(named_traces([tr, rel]))[1]
    ['cp_lrp', 'backward rule cp_lrp']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import traitlets as t
import xarray as xr

from vitcam_nb.capture.reader import is_store
from vitcam_nb.core.errors import ArgumentTypeError, TraceError
from vitcam_nb.core.recipe import Recipe
from vitcam_nb.core.rules import DEFAULT_RULE
from vitcam_nb.widgets.controls import coerce_request, controls
from vitcam_nb.widgets.facts import TraceFacts
from vitcam_nb.widgets.results import compute_grid, error_text

__all__ = ["TracePicker", "is_trace_set", "named_traces", "trace_choices", "trace_rule"]


def is_trace_set(value: object) -> bool:
    """Whether an Explorer's first argument holds several traces (a dict of named traces, or a list or tuple).

    Example:
        >>> is_trace_set({"gradient": None}), is_trace_set(xr.Dataset()), is_trace_set("x")
        (True, False, False)
    """
    if isinstance(value, (xr.Dataset, xr.DataTree)):  # both are Mappings of their variables: one trace each
        return False
    return isinstance(value, Mapping) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def trace_rule(trace: xr.Dataset) -> str:
    """The backward rule a trace was made with (``"gradient"`` for a plain trace).

    Example:
        >>> trace_rule(xr.Dataset(attrs={"backward_rule": "attnlrp"}))
        'attnlrp'
    """
    return str(trace.attrs.get("backward_rule", DEFAULT_RULE))


def named_traces(traces: Mapping[str, xr.Dataset] | Sequence[xr.Dataset]) -> dict[str, xr.Dataset]:
    """``{name: trace}`` of an Explorer's traces: a dict keeps its names, a list or tuple names each trace by its
    backward rule. Refused before any map is computed: no trace, a name that is not a non-empty string, or a value
    that is not a single trace (``TypeError``, as for one trace); two traces of one rule in a list, and traces of
    different inputs (their ``input_sha256`` differ: one Explorer shows one image) (:class:`TraceError`).

    Example:
        >>> named_traces([])  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        vitcam_nb.core.errors.ArgumentTypeError: trace: expected at least one trace, got an empty list
    """
    if isinstance(traces, Mapping):
        named = dict(traces)
        bad = [k for k in named if not isinstance(k, str) or not k]
        if bad:
            raise ArgumentTypeError(f"trace: the names of a dict of traces must be non-empty strings, got {bad[0]!r}")
    else:
        named = {}
        for trace in traces:
            name = trace_rule(trace) if isinstance(trace, xr.Dataset) else f"#{len(named)}"
            if name in named:
                raise TraceError(f"trace: two traces of backward rule {name!r}; pass a dict {{name: trace}} to name "
                                 "them")
            named[name] = trace
    if not named:
        raise ArgumentTypeError(f"trace: expected at least one trace, got an empty {type(traces).__name__}")
    for name, trace in named.items():
        if not isinstance(trace, xr.Dataset) or is_store(trace):
            what = "a many-image store" if is_store(trace) else type(trace).__name__
            raise ArgumentTypeError(f"trace {name!r}: several traces in one Explorer must be single-image Datasets of "
                                    f"vitcam_nb.trace(), got {what} (a store has its own image picker: "
                                    f"vc.Explorer(store))")
        if "input_sha256" not in trace.attrs:
            raise TraceError(f"trace {name!r}: has no input_sha256; pass a Dataset made by vitcam_nb.trace()")
    first, hash0 = next(iter(named)), str(next(iter(named.values())).attrs["input_sha256"])
    for name, trace in named.items():
        other = str(trace.attrs["input_sha256"])
        if other != hash0:
            raise TraceError(f"trace: the traces of one Explorer must be of one input; {first!r} has input hash "
                             f"{hash0[:12]}… and {name!r} has {other[:12]}… (trace the same image with each rule)")
    return named


def trace_choices(named: Mapping[str, xr.Dataset]) -> list[list[str]]:
    """The page's trace picker: ``[name, label]`` per trace, the label naming its backward rule (plain text; the
    name is said once when it is the rule's).

    Example:
        >>> trace_choices({"a": xr.Dataset(attrs={"backward_rule": "libragrad"})})
        [['a', 'a · backward rule libragrad']]
    """
    out = []
    for name, trace in named.items():
        rule = trace_rule(trace)
        out.append([name, f"backward rule {rule}" if name == rule else f"{name} · backward rule {rule}"])
    return out


class TracePicker(t.HasTraits):
    """The Explorer's trace picker (a mixin of :class:`~vitcam_nb.widgets.Explorer`, kept apart from its round
    trip): with several traces of one image, the page offers them by name and a switch keeps the recipe; the map,
    recipe id, methods paragraph and checklist are then those of the new trace. A switch the new trace cannot give
    (e.g. a rule preset on the gradient trace) is refused and the trace and controls stay at what is shown.

    Example:
        >>> ex = vc.Explorer({"gradient": tr, "cp_lrp": rel})  # doctest: +SKIP
        >>> ex.trace_name = "cp_lrp"                            # doctest: +SKIP
    """

    #: With several traces of one image: [name, label] of each, for the page's trace picker; empty otherwise.
    trace_choices = t.List().tag(sync=True)
    #: With several traces: the name of the trace shown (set by the kernel once it is shown).
    trace_shown = t.Unicode().tag(sync=True)
    #: The page's trace picker: {"id": int, "name": str}; answered like an image request (trace_shown, or error).
    trace_request = t.Dict().tag(sync=True, echo_update=False)

    _traces: dict[str, xr.Dataset]

    @property
    def traces(self) -> dict[str, xr.Dataset]:
        """The traces this explorer switches between, by name (empty for a single trace or a store).

        Example:
            >>> list(vc.Explorer([tr, rel]).traces)  # doctest: +SKIP
            ['gradient', 'cp_lrp']
        """
        return dict(self._traces)

    @property
    def trace_name(self) -> str:
        """With several traces: the name of the trace shown; setting it switches the trace and keeps the recipe
        (a recipe the other trace cannot give raises, and nothing changes).

        Example:
            >>> ex.trace_name = "cp_lrp"  # doctest: +SKIP
        """
        return str(self.trace_shown)

    @trace_name.setter
    def trace_name(self, value: str) -> None:
        if not self._traces:
            raise ArgumentTypeError("trace_name: this Explorer shows one trace; pass several traces of one image "
                                    "(vc.Explorer({'gradient': tr, 'cp_lrp': rel})) to switch between them")
        if not isinstance(value, str) or value not in self._traces:
            raise TraceError(f"trace_name: expected one of {list(self._traces)}, got {value!r}")
        self._show_trace(value)

    def _show_trace(self, name: str) -> None:
        """Show trace ``name`` with the current recipe; raises (changing nothing) if it cannot."""
        if name == self.trace_shown:
            return
        trace = self._traces[name]
        facts = TraceFacts.of(trace)
        result = compute_grid(trace, self._recipe)
        self._trace, self._facts = trace, facts
        with self.hold_sync():  # controls, trace name and map in one message: the page never mixes two traces
            self.options = controls(facts)
            self.trace_shown = name
            self._publish(result, response_id=self.response_id)

    def _elsewhere(self, request: Mapping) -> str:
        """For a page request refused on the trace shown: the other traces that give it (e.g. the rule trace of a
        rule preset), named in the refusal so that the user switches trace rather than traces again."""
        names = []
        for name, trace in self._traces.items():
            if trace is self._trace:
                continue
            try:
                draft = {**self._recipe.to_dict(), **request["recipe"]}
                fields = coerce_request(draft, list(request.get("changed") or []), TraceFacts.of(trace))
                compute_grid(trace, Recipe.from_dict(fields))
            except Exception:  # noqa: BLE001 - a malformed request, or one this trace refuses too: not named
                continue
            names.append(name)
        if not names:
            return ""
        return f"; this Explorer's trace {' and '.join(map(repr, names))} gives it: switch trace with the trace picker"

    def _on_trace_request(self, change: dict) -> None:
        request = change["new"] or {}
        try:
            name = request.get("name")
            if not isinstance(name, str) or name not in self._traces:
                raise TraceError(f"trace: expected one of {list(self._traces)}, got {name!r}")
            self._show_trace(name)
        except Exception as exc:  # e.g. a rule preset the other trace cannot give: said in the page, trace kept
            if not isinstance(exc, ValueError):
                self.log.warning("vitcam_nb Explorer: unexpected error", exc_info=True)
            with self.hold_sync():
                self.error = error_text(exc)
                self.frame += 1
            return
        self._prefetch()
