"""`zipage eval`: the quality basket. `common` holds what every task shares (configurations,
budgets, splits, reports); each task (fidelity, needle, recall, vartrack) is one module.
"""
