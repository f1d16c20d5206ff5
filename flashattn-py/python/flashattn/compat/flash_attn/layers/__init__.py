__flashattn_compat__ = True
