"""Spark stages: heavy windowed aggregations run as PySpark jobs, and backfill.

Importing this package is cheap: pyspark is imported by :mod:`millwheel.spark.session`
only, and only when the first job runs.
"""

from __future__ import annotations

from typing import Any

from millwheel.computation import Computation


def spark_aggregate(**params: Any) -> Computation:
    """Factory behind the built-in code name ``spark_aggregate`` (imports the stage lazily,
    so registering built-ins never touches Spark). Without pyspark installed it raises
    :class:`~millwheel.errors.MissingDependencyError` saying how to install it."""
    from millwheel.spark.session import require_pyspark
    from millwheel.spark.stage import SparkAggregate

    require_pyspark("spark_aggregate (a Spark stage)")

    return SparkAggregate(**params)
