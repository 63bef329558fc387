"""``optimizer.state`` that knows when it changes: a version counter bumped by every change to
the table or to a parameter's state dict, so that a cached step plan sees a state reset or
replaced by hand (``opt.state[p] = {}``, ``opt.state.clear()``, ``opt.state[p].clear()``)."""
from collections import defaultdict


class _ParamState(dict):
    """One parameter's state: a dict that tells its table when it changes."""

    __slots__ = ("_table",)

    def __init__(self, *args, table=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._table = table

    def _changed(self):
        if self._table is not None:
            self._table.version += 1

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._changed()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._changed()

    def _mutator(name):
        def method(self, *args, **kwargs):
            result = getattr(dict, name)(self, *args, **kwargs)
            self._changed()
            return result
        method.__name__ = name
        return method

    clear, pop, popitem = _mutator("clear"), _mutator("pop"), _mutator("popitem")
    update, setdefault = _mutator("update"), _mutator("setdefault")
    del _mutator

    def __reduce__(self):  # copies and pickles are plain dicts
        return dict, (dict(self),)


class StateTable(defaultdict):
    """``optimizer.state``: a defaultdict(dict) whose ``version`` counts every change to it or to
    a parameter's state, so that the cached step plan sees a state reset or replaced by hand."""

    def __init__(self, items=()):
        super().__init__(self._new_state)
        self.version = 0
        for k, v in dict(items).items():
            self[k] = v

    def _new_state(self):
        return _ParamState(table=self)

    def __setitem__(self, k, v):
        if not isinstance(v, _ParamState) or v._table is not self:
            v = _ParamState(v, table=self)
        super().__setitem__(k, v)
        self.version += 1

    def __delitem__(self, k):
        super().__delitem__(k)
        self.version += 1

    def _mutator(name):
        def method(self, *args, **kwargs):
            result = getattr(defaultdict, name)(self, *args, **kwargs)
            self.version += 1
            return result
        method.__name__ = name
        return method

    clear, pop, popitem = _mutator("clear"), _mutator("pop"), _mutator("popitem")
    del _mutator

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, k, default=None):
        if k not in self:
            self[k] = {} if default is None else default
        return self[k]

    def __reduce__(self):  # copies and pickles are plain defaultdict(dict)s
        return defaultdict, (dict,), None, None, ((k, dict(v)) for k, v in self.items())
