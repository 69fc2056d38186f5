"""What verl loads in every process through the ``verl.plugins`` entry point.

``import verl`` imports this module in the driver and in every Ray worker (verl's
``VERL_USE_EXTERNAL_PLUGINS`` policy, default ``auto``). It registers, through verl's and
TransferQueue's own registries and hooks:

* the TransferQueue storage backend ``Conduit`` (:mod:`conduit_verl.tq_storage`);
* the worker-side minibatch delivery (:mod:`conduit_verl.delivery`), which stays inactive
  until the backend is ``Conduit`` or ``CONDUIT_VERL_DELIVERY`` asks for it;
* on a host without any accelerator, the CPU platform and the ``hf`` rollout
  (:mod:`conduit_verl.cpu`), for tests and demos.

verl swallows plugin import errors at debug level, so failures are logged here as warnings.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("conduit_verl")


def _load() -> None:
    from conduit_verl.compat import UnsupportedVerlError, require_supported_verl

    try:
        require_supported_verl("conduit-verl's verl plugin")
    except UnsupportedVerlError as e:
        logger.warning("%s Conduit stays off.", e)
        return
    import conduit_verl.tq_storage  # noqa: F401  (registers the "Conduit" TransferQueue backend)
    from conduit_verl import delivery

    delivery.install()
    from conduit_verl import cpu

    cpu.maybe_register()


try:
    _load()
except Exception:  # verl would hide this at debug level
    logger.warning("conduit-verl plugin failed to load; Conduit stays off.", exc_info=True)
