USES_DRAFT = True
def run(*a, **k):
    raise NotImplementedError("exspec: pending")
