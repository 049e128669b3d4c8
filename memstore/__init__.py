"""memstore: an in-memory replicated checkpoint store for distributed PyTorch training.

The store server lives here; ``trainer_client`` is the library used inside trainers. This package's
``__init__`` stays import-light: ``memstore.v1`` (the generated wire contract) is imported by clients.
"""

__version__ = "0.1.0"
