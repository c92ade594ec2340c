"""Every step's gradients averaged through the roles, as DDP does: the synchroniser, its bucket
layout, which parameters took part (usage), its checkpoint state, its rollback point and the
measured fusion plan's tuner."""
