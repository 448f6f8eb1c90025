"""Loading: the rule engine (inject), the checkpoint reader and weight loading, the typed load context
shared by operators, and runtime statistics. Imports models/, runtime/ and the leaf packages below it,
never operators/, engine/ or apps/."""
