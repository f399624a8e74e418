from hpcserve.cli.doctor import main

main()
