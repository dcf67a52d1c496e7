"""Go-live judgement of a run dir: validate (the checklist), doctor (troubleshooting), drill (fault rehearsal)."""
