"""The data pipeline's one error type, below every module that raises it."""


class DataError(ValueError):
    """The data (files, contents, loader state) cannot give training windows; says why."""
