from radixserve.children import arm_parent_death

arm_parent_death()  # before anything else runs: see radixserve.children.spawn

from radixserve.cli import main  # noqa: E402

main()
