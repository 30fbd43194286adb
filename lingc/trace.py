def trace(*a, **k): raise NotImplementedError
