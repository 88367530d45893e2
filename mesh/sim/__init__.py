"""The simulation harness: a seeded scenario driven over real A2A, and its report.

``plan_scenario`` (what each package does) → ``run_simulation`` (start or target a
coordinator, submit every package, sample ``/capacity``; with a :class:`Neighbour`, a
second tenant that comes and goes on a seeded schedule) → ``write_report`` (JSON, Markdown,
plots; per neighbour phase, :func:`phase_summary`); ``run_compare`` and ``run_sweep``
repeat the same scenario over one setting.
"""
