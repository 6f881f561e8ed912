"""The run summary says when the run was oversubscribed (more processes than cores)."""

from resihp.launch.report import cores_available, oversubscription


def test_more_processes_than_cores_is_said_with_what_it_does_to_the_figures():
    cores = cores_available()
    busy = oversubscription(cores + 2)
    assert busy["oversubscribed"] and busy["processes"] == cores + 2 and busy["cpu_cores"] == cores
    assert "slowdowns come out smaller" in busy["oversubscribed_note"]
    assert not oversubscription(cores)["oversubscribed"]
    assert not oversubscription(cores + 2, device="cuda")["oversubscribed"]
