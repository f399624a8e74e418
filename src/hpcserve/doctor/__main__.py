from hpcserve.doctor.cli import main

main()
