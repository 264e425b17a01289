"""From YAML and ``key=value`` overrides to a checked Config: loading recipes and overrides
(``load``), the typed build (``build``), defaults from other keys (``defaults``), the checks by
topic (``checks``), verl's keys of features not here (``verl_compat``), the packages a config
names (``packages``)."""
