"""From YAML and ``key=value`` overrides to a checked Config: loading (``load``), the checks by
topic (``checks``), verl's keys of features not here (``verl_compat``), the packages a config
names (``packages``)."""
