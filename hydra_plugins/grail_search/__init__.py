"""grail's Hydra plugins. Hydra instantiates plugins only from the `hydra_plugins` namespace
package, so the search sweeper (grail/study/search.py) is named here; `hydra_plugins/` itself has no
`__init__.py`, so it merges with the other installed plugins (hydra-submitit-launcher's)."""
