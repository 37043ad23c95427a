"""The batched executor (``runtime.executor: batched``): each client's ``client_update`` runs as a coroutine
paused at its local fits (``executor``, ``fit_request``), and the paused fits of clients of one architecture
train as one vmapped computation (``fits`` forms the groups and falls back, ``randomness`` finding the random
layers that keep a fit sequential before any attempt; ``group_training`` trains a
group on a ``flat_store`` of stacked tensors laid out by ``placement``, with batches made by ``gathering``,
``stacked_optim``'s update rules, ``reparametrize``'s module swap and ``step_closures``' rebuilt step
functions; in lockstep, ``lockstep`` pads the batches and ``masked_norm`` keeps batch norm to the real rows).
"""

from ..steps import vmappable  # where strategies written before found it
from .executor import BatchedExecutor

__all__ = ["BatchedExecutor", "vmappable"]
