from hpcserve.cli.main import main

main()
