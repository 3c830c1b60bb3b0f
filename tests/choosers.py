"""Auto-k test helpers shared by several test modules: cost tables of a chosen shape, and a chooser that
follows a fixed script of k (every k change and k = 0 step the real chooser could make)."""
from specdec.autok import CostTable, KChooser

SCRIPT = (3, 0, 0, 5, 1, 0, 2, 4, 1, 1)  # k of successive steps: it changes every step, k = 0 included


def linear_costs(target_fixed, target_per_token, draft_fixed, draft_per_token, m_max=256):
    """A cost table with t(M) = fixed + per_token * M at powers of two."""
    ms = [2 ** i for i in range(m_max.bit_length())]
    return CostTable({m: target_fixed + target_per_token * m for m in ms},
                     {m: draft_fixed + draft_per_token * m for m in ms})


class ScriptedChooser(KChooser):
    """k from a fixed cycle, whatever the costs: every k change and k = 0 step the real chooser could make."""

    def __init__(self, script, k_max):
        super().__init__(k_max, linear_costs(1.0, 0.0, 0.1, 0.0))
        self.script, self.i = script, 0

    def choose(self, batch, offers=None, free=False):
        k = self.script[self.i % len(self.script)]
        self.i += 1
        self.last = (len(batch), k, 2, 0.0, None)
        return k

    def stop_threshold(self, batch, k):
        return 0.0  # the script's k exactly: no row stops drafting early
