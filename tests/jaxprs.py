"""Reading traced programs in tests."""
from __future__ import annotations

from jax.extend.core import jaxprs_in_params

# Primitives XLA:GPU runs by copying a device predicate to the host and waiting for it: a
# jitted step that holds one is dispatched synchronously.
HOST_SYNCING = frozenset({"cond", "while"})


def primitives_outside_kernels(jaxpr) -> set[str]:
  """The primitives a jaxpr runs, its sub-jaxprs included, but not inside Pallas kernels
  (on the GPU a kernel is one launch, whatever control flow its body has)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if eqn.primitive.name != "pallas_call":
      for sub in jaxprs_in_params(eqn.params):
        names |= primitives_outside_kernels(sub)
  return names
