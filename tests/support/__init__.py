"""What the tests share: rank functions (module-level, so a RankPool pickles them by
reference), subprocess helpers and reference implementations."""
