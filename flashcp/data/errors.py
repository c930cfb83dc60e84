"""The data pipeline's error types, below every module that raises them."""


class DataError(ValueError):
    """The data (files, contents, loader state) cannot give training windows; says why."""


class DataChanged(DataError):
    """Data changed (or was cut short) under a running job, named with its span: nothing trained after
    it was found may be published as a checkpoint."""
