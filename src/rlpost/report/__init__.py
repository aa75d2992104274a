"""`rlpost report`: one offline HTML page of runs, a run comparison or a sweep (rlpost.report.command)."""
