from tsenor_cli.cli import main

main()
