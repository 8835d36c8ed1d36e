"""hydra/sweeper=grail_race: racing over seeds (grail/study/race.py, grail/study/race_sweeper.py),
named here because Hydra instantiates plugins only from the `hydra_plugins` namespace package."""
