"""One static HTML report per run folder (load test, sweep or scenario suite): readable offline."""
